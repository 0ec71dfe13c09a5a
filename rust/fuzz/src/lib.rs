//! Fuzz harnesses for dflash-core.
//!
//! Each harness decodes the fuzzer's bytes into a small configuration and a sequence of
//! operations (with [`arbitrary`]), drives the core with them and checks the core's invariants
//! after every operation. A panic is a finding: either the core panicked by itself, or a check
//! here failed (each check's message says which property broke).
//!
//! The harnesses are plain functions so that the seed corpus and the regression inputs can be
//! replayed by `cargo test` on stable Rust, without libFuzzer (see `tests/replay.rs`).

pub mod kv;
pub mod sched;

use std::sync::OnceLock;

/// Known findings (open bugs in dflash-core, see docs/FUZZING.md) that a run tolerates, so
/// that fuzzing can go past them. Empty (the default): every finding is a crash.
#[derive(Debug, Clone, Default)]
pub struct Allow(Vec<String>);

/// Every known finding, by name.
pub const KNOWN_FINDINGS: [&str; 0] = [];

impl Allow {
    /// Tolerate nothing.
    pub fn none() -> Self {
        Self(Vec::new())
    }

    /// Tolerate every known finding.
    pub fn all_known() -> Self {
        Self(KNOWN_FINDINGS.iter().map(|s| (*s).to_owned()).collect())
    }

    /// From `DFLASH_FUZZ_ALLOW`: a comma-separated list of finding names, or `all-known`
    /// (read once per process).
    pub fn from_env() -> &'static Allow {
        static ALLOW: OnceLock<Allow> = OnceLock::new();
        ALLOW.get_or_init(|| {
            let names: Vec<String> = std::env::var("DFLASH_FUZZ_ALLOW")
                .unwrap_or_default()
                .split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect();
            if names.iter().any(|n| n == "all-known") {
                Allow::all_known()
            } else {
                for n in &names {
                    assert!(
                        KNOWN_FINDINGS.contains(&n.as_str()),
                        "DFLASH_FUZZ_ALLOW: unknown finding {n:?}; known: {KNOWN_FINDINGS:?}"
                    );
                }
                Allow(names)
            }
        })
    }

    /// Whether finding `name` is tolerated.
    pub fn has(&self, name: &str) -> bool {
        self.0.iter().any(|a| a == name)
    }
}

/// Tokens of shared prompt template `template` (so that different requests share prefixes), then
/// `suffix_len` pseudo-random tokens from `seed`. Small alphabets make blocks collide often.
pub fn prompt_tokens(template: u8, prefix_len: usize, suffix_len: usize, seed: u32) -> Vec<u32> {
    let t = u32::from(template % 4);
    let mut tokens: Vec<u32> = (0..prefix_len as u32)
        .map(|i| 100 + ((t * 7 + i * (t + 1)) % 13))
        .collect();
    let mut x = Lcg::new(seed);
    tokens.extend((0..suffix_len).map(|_| 100 + x.next() % 7));
    tokens
}

/// A tiny deterministic generator for token values (the fuzzer steers the seeds).
#[derive(Debug, Clone)]
pub struct Lcg(u64);

impl Lcg {
    /// A generator started from `seed`.
    pub fn new(seed: u32) -> Self {
        Self(u64::from(seed) ^ 0x9E37_79B9_7F4A_7C15)
    }

    /// Next value (upper bits of a 64-bit LCG).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) as u32
    }
}
