//! Per-step cost of the core scheduler without Python: N running DFlash requests decoding,
//! uniform 0..K acceptance. `cargo run --release -p dflash-core --example step_cost -- 1024 8`
//!
//! The calls of the measured steps (from step 200 on) go through the `measure_*` functions, so
//! that callgrind can count them alone:
//! `valgrind --tool=callgrind --toggle-collect='step_cost::measure_*' target/release/examples/step_cost 1024 8`
//! with e.g. `STEPS=260` (instructions per step = collected / measured steps).

use std::time::Instant;

use dflash_core::{
    CoreResult, RequestSpec, Scheduler, SchedulerConfig, SpecMethod, StepOutput, UpdateOutput,
};

/// Steps before the measured ones (the prompts' prefills are over by then).
const WARMUP_STEPS: usize = 200;

/// `schedule()` of a measured step (never inlined: callgrind counts it by name).
#[inline(never)]
fn measure_schedule(sched: &mut Scheduler, out: &mut StepOutput) -> CoreResult<()> {
    sched.schedule(out)
}

/// `update_from_output()` of a measured step.
#[inline(never)]
fn measure_update(
    sched: &mut Scheduler,
    step_id: u64,
    tokens: &[u32],
    counts: &[u32],
    upd: &mut UpdateOutput,
) -> CoreResult<()> {
    sched.update_from_output(step_id, tokens, counts, upd)
}

/// `update_draft_token_ids_for_slots()` of a measured step.
#[inline(never)]
fn measure_drafts(
    sched: &mut Scheduler,
    slots: &[(u32, u32)],
    drafts: &[u32],
    counts: &[u32],
) -> CoreResult<usize> {
    sched.update_draft_token_ids_for_slots(slots, drafts, counts)
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let n = args.first().copied().unwrap_or(1024);
    let k = args.get(1).copied().unwrap_or(8);
    let mut config = SchedulerConfig::new(n * 520 + 10, 16, 8192, n, 16384);
    config.spec_method = SpecMethod::DFlash;
    config.num_speculative_tokens = k;
    if std::env::var("PC").as_deref() == Ok("0") {
        config.enable_prefix_caching = false;
    }
    if let Ok(a) = std::env::var("HASH") {
        config.hash_algo = dflash_core::HashAlgo::from_name(&a).expect("algo");
    }
    if std::env::var("VERIFY").as_deref() == Ok("0") {
        config.verify_prefix_hits = false;
    }
    let mut sched = Scheduler::new(config).expect("config");
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for i in 0..n {
        let len = 128 + (rand() % 896) as usize;
        let prompt = (0..len).map(|_| (rand() % 32000) as u32 + 3).collect();
        let spec = RequestSpec {
            request_id: format!("r{i}"),
            prompt_token_ids: prompt,
            max_tokens: 4096,
            ..Default::default()
        };
        sched.add_request(spec).expect("add");
    }
    let (mut out, mut upd) = (StepOutput::default(), UpdateOutput::default());
    let (mut tokens, mut counts, mut drafts, mut draft_counts) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut times = Vec::new();
    // THRASH=MB: overwrite MB megabytes between calls, as an engine's own work between
    // scheduler calls evicts the scheduler's data from the caches.
    let thrash_mb: usize = std::env::var("THRASH")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let mut thrash_buf = vec![0u8; thrash_mb << 20];
    let mut thrash = move || {
        for (i, b) in thrash_buf.iter_mut().step_by(64).enumerate() {
            *b = b.wrapping_add(i as u8);
        }
        std::hint::black_box(&thrash_buf);
    };
    let num_steps: usize = std::env::var("STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(400);
    for step in 0..num_steps {
        let measured = step >= WARMUP_STEPS;
        thrash();
        let t0 = Instant::now();
        if measured {
            measure_schedule(&mut sched, &mut out)
        } else {
            sched.schedule(&mut out)
        }
        .expect("schedule");
        let t1 = Instant::now();
        tokens.clear();
        counts.clear();
        for i in 0..out.num_reqs() {
            if out.is_prefill_chunk[i] {
                counts.push(0);
                continue;
            }
            let accepted = (rand() % (out.num_spec_tokens[i] as u64 + 1)) as u32;
            counts.push(accepted + 1);
            tokens.extend((0..=accepted).map(|_| (rand() % 32000) as u32 + 3));
        }
        thrash();
        let t2 = Instant::now();
        if measured {
            measure_update(&mut sched, out.step_id, &tokens, &counts, &mut upd)
        } else {
            sched.update_from_output(out.step_id, &tokens, &counts, &mut upd)
        }
        .expect("update");
        let t3 = Instant::now();
        let slots: Vec<(u32, u32)> = out
            .slots
            .iter()
            .map(|&s| (s, sched.requests().generation(s)))
            .collect();
        draft_counts.clear();
        drafts.clear();
        for i in 0..out.num_reqs() {
            let c = if out.is_prefill_chunk[i] { 0 } else { k as u32 };
            draft_counts.push(c);
            drafts.extend((0..c).map(|_| 7u32));
        }
        thrash();
        let t4 = Instant::now();
        if measured {
            measure_drafts(&mut sched, &slots, &drafts, &draft_counts)
        } else {
            sched.update_draft_token_ids_for_slots(&slots, &drafts, &draft_counts)
        }
        .expect("drafts");
        let t5 = Instant::now();
        if measured && out.num_reqs() == n && !out.is_prefill_chunk.iter().any(|&c| c) {
            times.push((
                (t1 - t0).as_nanos(),
                (t3 - t2).as_nanos(),
                (t5 - t4).as_nanos(),
            ));
        }
    }
    let median = |f: fn(&(u128, u128, u128)) -> u128| {
        let mut v: Vec<u128> = times.iter().map(f).collect();
        v.sort_unstable();
        v[v.len() / 2] as f64 / 1e3
    };
    println!(
        "N={n} K={k}: {} decode steps; p50 schedule {:.1} us, update_from_output {:.1} us, drafts {:.1} us",
        times.len(),
        median(|t| t.0),
        median(|t| t.1),
        median(|t| t.2)
    );
}
