//! State-machine property tests of the KV-cache manager against a reference model.
//!
//! Random operation sequences (add a request, look up its prefix and allocate slots, append decoded
//! tokens, preempt, finish, reset the prefix cache) run on the real [`KvCacheManager`] and on a
//! small model of vLLM V1's rules for one full-attention group, written from the spec (§1, §2) and
//! not from the Rust code. After every operation the two must agree block for block, and the
//! spec's invariants 1-16 (§7) that apply to one group are checked directly:
//!
//! | invariant | checked in |
//! |---|---|
//! | 1 null block, free + used == usable; 2 free queue <=> ref 0; 5 hash <=> registered | `check_all` |
//! | 3 touch / tail-first free order; 16 every block released once, unknown free is a no-op | model + `Harness::free` |
//! | 4 new blocks = free-queue head, ref 1, no hash; 12 block count; 14 append-only; 15 cached count | `check_allocation` |
//! | 6 duplicates keep their entries; 13 free hits cost capacity | model (first-inserted lookups, `blocks_to_allocate`) |
//! | 7 only full blocks of known tokens hashed | `check_request_hashes` |
//! | 8 hash chain | `block_hash_chain_depends_on_every_earlier_token` |
//! | 9 reset refused while held | `Harness::reset_prefix_cache` |
//! | 10 hit cap and alignment (no EAGLE drop: DFlash @0.33 keeps the last block) | `Harness::schedule` |
//! | 11 None <=> capacity check fails, and then nothing changed | model outcome + `Snapshot` |
//!
//! The model is content addressed: it keys a cached block by (LoRA, salt, every token up to the end
//! of the block), never by a hash, so it also catches a hasher that merges different prefixes or
//! splits equal ones.
//!
//! Failing seeds are saved to `rust/core/proptest-regressions/kv_state_machine.txt` and replayed
//! first on every run; commit that file with the fix. `PROPTEST_CASES=N` overrides the case count.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};

use dflash_core::{
    pool::FreeQueue, AllocateArgs, BlockHash, BlockHasher, CoreError, ExtraKeys, HashAlgo,
    KvCacheManager, PrefixCacheStats, RequestBlocks, SequenceView, NULL_BLOCK,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{FileFailurePersistence, TestCaseError, TestRunner};

/// Cases of the state-machine test: about 5-15 s in release on one (shared) core. Debug builds
/// (which also turn on the core's debug assertions) run fewer, in about the same time.
const STATE_MACHINE_CASES: u32 = if cfg!(debug_assertions) {
    2_000
} else {
    40_000
};
const REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proptest-regressions/kv_state_machine.txt"
);
const BLOCK_SIZES: [usize; 4] = [1, 2, 4, 16];
const ALGOS: [HashAlgo; 3] = [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128];
/// Tokens come from a 7-letter alphabet so that unrelated prompts share blocks too.
const ALPHABET: u32 = 7;

fn proptest_config(default_cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        source_file: Some(file!()),
        ..ProptestConfig::default()
    }
}

mod examples;
mod harness;
mod input;
mod model;
mod properties;

use harness::*;
use input::*;
use model::*;
