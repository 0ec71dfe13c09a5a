//! Replays the committed seed corpus and the saved regression inputs through the harnesses,
//! on stable Rust and without libFuzzer: `cargo test --release` in `rust/fuzz`.

use std::fs;
use std::panic;
use std::path::{Path, PathBuf};

fn files(dir: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut files: Vec<PathBuf> = match fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.file_name().is_some_and(|n| n != "README.md"))
            .collect(),
        Err(_) => Vec::new(),
    };
    files.sort();
    files
}

fn replay(dir: &str, run: fn(&[u8])) -> Vec<String> {
    let mut failures = Vec::new();
    for path in files(dir) {
        let data = fs::read(&path).unwrap();
        if panic::catch_unwind(|| run(&data)).is_err() {
            failures.push(path.display().to_string());
        }
    }
    failures
}

/// A harness run with the given tolerance.
type Runner = fn(&[u8], &dflash_fuzz::Allow);

fn kv(data: &[u8]) {
    dflash_fuzz::kv::run_with(data, &dflash_fuzz::Allow::none());
}

fn sched(data: &[u8]) {
    dflash_fuzz::sched::run_with(data, &dflash_fuzz::Allow::none());
}

#[test]
fn seed_corpus_passes() {
    assert!(
        files("corpus/kv_ops").len() >= 10,
        "kv_ops seed corpus missing"
    );
    assert!(
        files("corpus/scheduler_ops").len() >= 10,
        "scheduler_ops seed corpus missing"
    );
    let mut failures = replay("corpus/kv_ops", kv);
    failures.extend(replay("corpus/scheduler_ops", sched));
    assert!(failures.is_empty(), "seed inputs fail: {failures:#?}");
}

/// Inputs that once crashed a target. An input named after an open finding in
/// `dflash_fuzz::KNOWN_FINDINGS` must still fail strictly and pass when that finding is
/// tolerated (so the harness can fuzz past it); once the bug is fixed it passes strictly and this
/// test says so: then drop the name from `KNOWN_FINDINGS` and from the harness. Any other input
/// must pass strictly.
#[test]
fn regressions_pass() {
    let mut problems = Vec::new();
    for target in ["kv_ops", "scheduler_ops"] {
        let run: Runner = if target == "kv_ops" {
            |d, a| {
                dflash_fuzz::kv::run_with(d, a);
            }
        } else {
            |d, a| {
                dflash_fuzz::sched::run_with(d, a);
            }
        };
        for path in files(&format!("regressions/{target}")) {
            let data = fs::read(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let strict_ok = panic::catch_unwind(|| run(&data, &dflash_fuzz::Allow::none())).is_ok();
            match dflash_fuzz::KNOWN_FINDINGS
                .iter()
                .find(|f| name.starts_with(*f))
            {
                Some(finding) => {
                    if strict_ok {
                        problems.push(format!(
                            "{target}/{name}: passes now: finding {finding} looks fixed; remove it \
                             from KNOWN_FINDINGS"
                        ));
                    }
                    let tolerated =
                        panic::catch_unwind(|| run(&data, &dflash_fuzz::Allow::all_known()));
                    if tolerated.is_err() {
                        problems.push(format!("{target}/{name}: fails even when tolerated"));
                    }
                }
                None if !strict_ok => problems.push(format!("{target}/{name}: fails")),
                None => {}
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// Random inputs from a fixed generator: a quick smoke run of both harnesses.
#[test]
fn random_inputs_smoke() {
    let n: usize = std::env::var("FUZZ_SMOKE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let mut rng = dflash_fuzz::Lcg::new(12345);
    let mut abandoned = 0;
    for case in 0..n {
        let len = 16 + rng.next() as usize % 1500;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        // Known findings are tolerated here; the regression inputs cover them.
        let allow = dflash_fuzz::Allow::all_known();
        let runs: [(&str, Runner); 2] = [
            ("kv_ops", |d, a| {
                dflash_fuzz::kv::run_with(d, a);
            }),
            ("scheduler_ops", |d, a| {
                dflash_fuzz::sched::run_with(d, a);
            }),
        ];
        if let Ok(stats) = panic::catch_unwind(|| dflash_fuzz::sched::run_with(&data, &allow)) {
            abandoned += stats.abandoned;
        }
        for (name, run) in runs {
            if panic::catch_unwind(|| run(&data, &allow)).is_err() {
                let path = std::env::temp_dir().join(format!("dflash-smoke-{name}-{case}"));
                fs::write(&path, &data).unwrap();
                panic!(
                    "{name} case {case} failed; input saved to {}",
                    path.display()
                );
            }
        }
    }
    assert!(abandoned > 0, "no random input lost a step in flight");
}

/// Prints the decoded operations of one input and runs it:
/// `FUZZ_INPUT=path FUZZ_TARGET=kv_ops|scheduler_ops cargo test --release explain -- --nocapture --ignored`.
#[test]
#[ignore]
fn explain() {
    let path = std::env::var("FUZZ_INPUT").expect("set FUZZ_INPUT to an input file");
    let target = std::env::var("FUZZ_TARGET").unwrap_or_else(|_| "scheduler_ops".into());
    let data = fs::read(&path).unwrap();
    if target == "kv_ops" {
        let input = dflash_fuzz::kv::KvInput::decode(&data);
        println!("{input:#?}");
        let allow = dflash_fuzz::Allow::from_env();
        println!("{:?}", dflash_fuzz::kv::run_input_with(&input, allow));
    } else {
        let input = dflash_fuzz::sched::SchedInput::decode(&data);
        println!("{input:#?}");
        println!("{:#?}", dflash_fuzz::sched::build_config(&input.config));
        let allow = dflash_fuzz::Allow::from_env();
        println!("{:?}", dflash_fuzz::sched::run_input_with(&input, allow));
    }
}

/// Behaviour features of one kv_ops run (what the seed generator wants covered).
fn kv_features(data: &[u8]) -> Option<Vec<String>> {
    let input = dflash_fuzz::kv::KvInput::decode(data);
    let s = panic::catch_unwind(|| dflash_fuzz::kv::run_input(&input)).ok()?;
    let b = |n: u32| n.min(4).next_power_of_two();
    Some(vec![
        format!("built={}", s.built),
        format!("adds={}", b(s.adds)),
        format!("steps_ok={}", b(s.steps_ok)),
        format!("steps_none={}", b(s.steps_none)),
        format!("hits={}", b(s.hit_blocks)),
        format!("raw_ok={}", b(s.raw_ok)),
        format!("raw_none={}", b(s.raw_none)),
        format!("raw_err={}", b(s.raw_err)),
        format!("preempts={}", b(s.preempts)),
        format!("resets={}", b(s.resets)),
    ])
}

/// Behaviour features of one scheduler_ops run.
fn sched_features(data: &[u8]) -> Option<Vec<String>> {
    let input = dflash_fuzz::sched::SchedInput::decode(data);
    let c = dflash_fuzz::sched::build_config(&input.config);
    let s = panic::catch_unwind(|| dflash_fuzz::sched::run_input(&input)).ok()?;
    let b = |n: u64| n.min(8).next_power_of_two();
    let cfg = format!(
        "{}/{}/{}/{}",
        c.spec_method.name(),
        c.enable_chunked_prefill,
        c.policy.name(),
        c.enable_prefix_caching
    );
    Some(vec![
        format!("cfg={cfg}"),
        format!("added={}", b(s.added.into())),
        format!("refused={}", b(s.refused.into())),
        format!("steps={}", b(s.steps.into())),
        format!("preemptions={}", b(s.preemptions)),
        format!("preempt+{cfg}={}", s.preemptions > 0),
        format!("accepted_drafts={}", b(s.accepted_drafts)),
        format!("finished={}", b(s.finished)),
        format!("hit_tokens={}", b(s.hit_tokens)),
        format!("refused_calls={}", b(s.refused_calls.into())),
        format!("abandoned={}", b(s.abandoned.into())),
        format!("drain_steps={}", b(s.drain_steps.into())),
    ])
}

/// Picks up to `max` inputs, in generation order, each adding a behaviour feature not yet
/// covered; deterministic.
fn pick_seeds(features: fn(&[u8]) -> Option<Vec<String>>, salt: u32, max: usize) -> Vec<Vec<u8>> {
    let mut rng = dflash_fuzz::Lcg::new(salt);
    let mut seen = std::collections::HashSet::new();
    let mut seeds = Vec::new();
    for _ in 0..6000 {
        let len = 24 + rng.next() as usize % 600;
        let data: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        let Some(f) = features(&data) else { continue };
        let new: Vec<String> = f.into_iter().filter(|x| !seen.contains(x)).collect();
        if !new.is_empty() {
            seen.extend(new);
            seeds.push(data);
            if seeds.len() == max {
                break;
            }
        }
    }
    seeds
}

/// Regenerates the committed seed corpus (deterministic):
/// `cargo test --release write_seed_corpus -- --ignored` in `rust/fuzz`.
#[test]
#[ignore]
fn write_seed_corpus() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    // Candidates that hit a finding are skipped; keep their panic messages quiet.
    panic::set_hook(Box::new(|_| {}));
    for (target, features, salt) in [
        ("kv_ops", kv_features as fn(&[u8]) -> Option<Vec<String>>, 1),
        ("scheduler_ops", sched_features, 2),
    ] {
        let dir = root.join("corpus").join(target);
        for old in files(&format!("corpus/{target}")) {
            fs::remove_file(old).unwrap();
        }
        fs::create_dir_all(&dir).unwrap();
        let seeds = pick_seeds(features, salt, 24);
        for (i, data) in seeds.iter().enumerate() {
            fs::write(dir.join(format!("seed-{i:02}")), data).unwrap();
        }
        println!("{target}: {} seeds", seeds.len());
    }
    let _ = panic::take_hook();
}
