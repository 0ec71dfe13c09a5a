//! Property test of the scheduler's ownership contract: after every `schedule()`, every position
//! the target model or the drafter writes for a scheduled request lies in a block it owns.
//! The legacy lookahead policies (bugs real engines shipped) must be caught by the same check.

mod common;

use dflash_core::{
    LookaheadPolicy, Scheduler, SchedulerConfig, SpecMethod, StepOutput, UpdateOutput,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Workload {
    method: SpecMethod,
    k: usize,
    block_size: usize,
    num_blocks: usize,
    budget: usize,
    max_model_len: usize,
    prompts: Vec<Vec<u32>>,
    max_tokens: Vec<usize>,
    seed: u64,
}

fn workload() -> impl Strategy<Value = Workload> {
    let methods = prop::sample::select(vec![
        SpecMethod::DFlash,
        SpecMethod::DFlash,
        SpecMethod::Eagle,
        SpecMethod::Mtp,
        SpecMethod::Ngram,
        SpecMethod::None,
    ]);
    (
        methods,
        1usize..=15,
        prop::sample::select(vec![1usize, 4, 16, 32]),
        8usize..64,
        any::<u64>(),
    )
        .prop_flat_map(|(method, k, block_size, num_blocks, seed)| {
            let k = if method == SpecMethod::None { 0 } else { k };
            let max_model_len = 24 + block_size * 6;
            let prompt = prop::collection::vec(0u32..4, 1..max_model_len - 1);
            (
                Just((
                    method,
                    k,
                    block_size,
                    num_blocks * 64 / block_size.max(1) + 4,
                    seed,
                    max_model_len,
                )),
                8usize..200,
                prop::collection::vec(prompt, 1..12),
                prop::collection::vec(1usize..40, 12),
            )
        })
        .prop_map(
            |(
                (method, k, block_size, num_blocks, seed, max_model_len),
                budget,
                prompts,
                max_tokens,
            )| {
                Workload {
                    method,
                    k,
                    block_size,
                    num_blocks,
                    budget,
                    max_model_len,
                    prompts,
                    max_tokens,
                    seed,
                }
            },
        )
}

/// Runs the workload; returns the first ownership violation found, if any.
fn run(w: &Workload, policy: LookaheadPolicy) -> Result<dflash_core::SchedulerStats, String> {
    let mut config = SchedulerConfig::new(w.num_blocks, w.block_size, w.max_model_len, 8, w.budget);
    config.spec_method = w.method;
    config.num_speculative_tokens = w.k;
    config.lookahead_policy = policy;
    // Half the workloads pad admissions with one token left to 1 + K (vLLM's uniform decode).
    config.pad_admitted_decodes = w.seed % 2 == 0;
    let mut sched = Scheduler::new(config).map_err(|e| e.to_string())?;
    for (i, prompt) in w.prompts.iter().enumerate() {
        // Shared prefix: even requests start with the same tokens so prefix hits happen.
        let mut tokens = if i % 2 == 0 {
            vec![9; w.block_size * 2]
        } else {
            Vec::new()
        };
        tokens.extend_from_slice(prompt);
        tokens.truncate(w.max_model_len - 1);
        let spec = dflash_core::RequestSpec {
            request_id: format!("r{i}"),
            prompt_token_ids: tokens,
            max_tokens: w.max_tokens[i],
            ..Default::default()
        };
        sched.add_request(spec).map_err(|e| e.to_string())?;
    }
    let mut rng = common::rng(w.seed);
    let (mut out, mut upd) = (StepOutput::default(), UpdateOutput::default());
    for _ in 0..400 {
        if sched.num_unfinished() == 0 {
            break;
        }
        sched.schedule(&mut out).map_err(|e| e.to_string())?;
        common::check_ownership(&sched, &out)?;
        sched.check_invariants().map_err(|e| e.to_string())?;
        let (tokens, counts) = common::random_output(&out, &mut rng, |r| r.next_u32() % 4 + 10);
        sched
            .update_from_output(out.step_id, &tokens, &counts, &mut upd)
            .map_err(|e| e.to_string())?;
        let drafts: Vec<(String, Vec<u32>)> = upd
            .updates
            .iter()
            .filter(|u| u.finish_reason.is_none())
            .filter_map(|u| sched.requests().get(u.slot).ok())
            .map(|r| (r.spec.request_id.clone(), vec![1; w.k]))
            .collect();
        sched
            .update_draft_token_ids(drafts.iter().map(|(id, d)| (id.as_str(), d.as_slice())))
            .map_err(|e| e.to_string())?;
    }
    sched.check_invariants().map_err(|e| e.to_string())?;
    Ok(sched.stats().clone())
}

// The contract (`common::check_ownership`), checked from the step output and block table alone.
proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn correct_policy_never_violates_ownership(w in workload()) {
        prop_assert!(run(&w, LookaheadPolicy::Correct).is_ok(), "{:?}", run(&w, LookaheadPolicy::Correct));
    }
}

/// DFlash, K=3, block 16: prompts whose length + K + 1 crosses a block boundary.
fn boundary_workload() -> Workload {
    Workload {
        method: SpecMethod::DFlash,
        k: 3,
        block_size: 16,
        num_blocks: 64,
        budget: 512,
        max_model_len: 256,
        prompts: (13..=16)
            .map(|n| (0..n as u32).map(|t| t + 100 * n as u32).collect())
            .collect(),
        max_tokens: vec![8; 12],
        seed: 1,
    }
}

#[test]
fn legacy_first_prefill_policy_is_caught() {
    let err = run(&boundary_workload(), LookaheadPolicy::LegacyFirstPrefill).unwrap_err();
    assert!(err.contains("owns only"), "{err}");
}

#[test]
fn legacy_k_policy_is_caught() {
    let err = run(&boundary_workload(), LookaheadPolicy::LegacyK).unwrap_err();
    assert!(err.contains("owns only"), "{err}");
}

#[test]
fn correct_policy_passes_the_boundary_workload() {
    run(&boundary_workload(), LookaheadPolicy::Correct).unwrap();
}

#[test]
fn tiny_pool_preempts_and_stays_correct() {
    let mut w = boundary_workload();
    w.num_blocks = 11;
    w.max_model_len = 10 * w.block_size; // what the pool holds
    w.prompts = (0..8)
        .map(|i| (0..30).map(|t| t + i * 1000).collect())
        .collect();
    w.max_tokens = vec![40; 12];
    let stats = run(&w, LookaheadPolicy::Correct).unwrap();
    assert!(
        stats.num_preemptions > 0,
        "the workload must exercise preemption"
    );
    assert_eq!(stats.num_finished, 8);
}
