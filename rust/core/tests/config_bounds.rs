//! A config is refused before anything is allocated when a size field is beyond int32, when the
//! tables it implies exceed the machine's memory, or when its pool cannot hold one
//! `max_model_len` request; and the ends of a request that a smaller pool (allowed on request)
//! can never hold reach the caller through `update_from_output`.

mod common;

use dflash_core::{
    CoreError, EndedRequest, FinishReason, KvCacheManager, Scheduler, SchedulerConfig, SpecMethod,
    UpdateOutput,
};
use proptest::prelude::*;

const I32: usize = i32::MAX as usize;

fn refusal(config: SchedulerConfig) -> String {
    match Scheduler::new(config) {
        Err(CoreError::InvalidArgument(message)) => message,
        Err(other) => panic!("expected InvalidArgument, got {other:?}"),
        Ok(_) => panic!("the config was accepted"),
    }
}

#[test]
fn the_issues_config_is_refused_before_its_2_tib_table_is_allocated() {
    let started = std::time::Instant::now();
    let message = refusal(SchedulerConfig::new(64, 16, 1 << 40, 8, 8192));
    assert!(
        message.starts_with("max_model_len (1099511627776) must be at most 2**31 - 1"),
        "{message}"
    );
    assert!(started.elapsed().as_secs_f64() < 0.1);
}

#[test]
fn every_size_field_is_bounded_by_int32() {
    type Set = fn(&mut SchedulerConfig, usize);
    let fields: [(&str, Set); 5] = [
        ("num_blocks", |c, v| c.num_blocks = v),
        ("block_size", |c, v| c.block_size = v),
        ("max_model_len", |c, v| c.max_model_len = v),
        ("max_num_seqs", |c, v| c.max_num_seqs = v),
        ("max_num_batched_tokens", |c, v| {
            c.max_num_batched_tokens = v
        }),
    ];
    for (name, set) in fields {
        let mut config = SchedulerConfig::new(64, 16, 1008, 8, 1024);
        set(&mut config, I32 + 1);
        let message = refusal(config);
        assert!(
            message.starts_with(&format!("{name} (2147483648) must be at most 2**31 - 1")),
            "{name}: {message}"
        );
    }
}

#[test]
fn a_block_table_beyond_memory_is_refused_naming_its_fields() {
    // max_num_seqs x cdiv(max_model_len, 1024) int32 entries: 16 PiB.
    let config = SchedulerConfig::new((1 << 21) + 1, 1024, I32, I32, 8192);
    let message = refusal(config);
    assert!(
        message.starts_with("the config needs 16.0 PiB up front"),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "the block table (max_num_seqs = {I32} rows of cdiv(max_model_len = {I32}, \
             block_size = 1024) = 2097152 int32 entries) takes 16.0 PiB"
        )),
        "{message}"
    );
}

#[test]
fn a_pool_beyond_memory_is_refused_by_the_scheduler_and_the_manager() {
    // Prefix caching keeps a copy of each block's tokens: num_blocks x block_size x 4 bytes.
    let message = refusal(SchedulerConfig::new(I32, 1 << 20, 1 << 20, 1, 8192));
    assert!(
        message.contains(&format!(
            "the pool's per-block tables (num_blocks = {I32} blocks, each with a copy of its \
             block_size = 1048576 tokens) take 8.0 PiB"
        )),
        "{message}"
    );
    let err = KvCacheManager::new(I32, 1 << 20, 1 << 20, true).unwrap_err();
    assert!(
        err.to_string()
            .starts_with("the config needs 8.0 PiB up front"),
        "{err}"
    );
    let err = KvCacheManager::new(I32 + 1, 16, 64, false).unwrap_err();
    assert!(
        err.to_string().starts_with("num_blocks (2147483648)"),
        "{err}"
    );
}

#[test]
fn the_pool_must_hold_one_max_model_len_request_unless_told_otherwise() {
    let message = refusal(SchedulerConfig::new(64, 16, 2048, 8, 1024));
    assert_eq!(
        message,
        "num_blocks (64) cannot hold one request of max_model_len (2048) tokens: that needs \
         cdiv(2048, block_size 16) = 128 blocks plus the null block, 129 in all; raise \
         num_blocks or lower max_model_len"
    );
    let just_enough = SchedulerConfig::new(129, 16, 2048, 8, 1024);
    assert_eq!(just_enough.min_num_blocks(), 129);
    assert!(Scheduler::new(just_enough).is_ok());
    let mut allowed = SchedulerConfig::new(64, 16, 2048, 8, 1024);
    allowed.pool_must_hold_max_model_len = false;
    assert!(Scheduler::new(allowed).is_ok());
}

/// A pool of 4 blocks of 16 (64 slots) with max_model_len 128, allowed explicitly.
fn small_pool() -> Scheduler {
    let mut config = SchedulerConfig::new(5, 16, 128, 8, 256);
    config.pool_must_hold_max_model_len = false;
    Scheduler::new(config).unwrap()
}

fn error_end(id: &str) -> EndedRequest {
    EndedRequest {
        request_id: id.to_owned(),
        finish_reason: FinishReason::Error,
    }
}

/// One step with one sampled token per entry; returns the update.
fn step(s: &mut Scheduler) -> UpdateOutput {
    let out = common::schedule(s);
    common::apply(s, &out, |_| vec![7])
}

#[test]
fn a_request_ended_while_running_is_reported_by_the_next_update_once() {
    let mut s = small_pool();
    common::add(&mut s, "a", 60, 20);
    for _ in 0..5 {
        assert!(step(&mut s).ended.is_empty()); // up to 65 tokens in 64 slots + the sampled one
    }
    let out = common::schedule(&mut s);
    assert_eq!(out.num_reqs(), 0);
    assert_eq!(out.finished_req_ids, ["a"]);
    let upd = common::apply(&mut s, &out, |_| vec![7]);
    assert_eq!(upd.ended, [error_end("a")]);
    assert!(upd.updates.is_empty());
    assert!(step(&mut s).ended.is_empty(), "reported once");
    assert_eq!(s.stats().num_preemptions, 0);
}

#[test]
fn a_request_ended_at_admission_is_reported_and_a_failed_update_keeps_it() {
    let mut s = small_pool();
    common::add(&mut s, "a", 60, 20);
    common::add(&mut s, "b", 10, 2);
    // "b" waits for blocks; "a" grows to 65 tokens, one more than the pool holds.
    for _ in 0..5 {
        step(&mut s);
    }
    let pending = common::schedule(&mut s); // "a" is ended, "b" admitted
    assert_eq!(common::ids(&s, &pending.slots), ["b"]);
    let mut upd = UpdateOutput::default();
    let refused = s.update_from_output(pending.step_id, &[1, 2, 3], &[3], &mut upd);
    assert!(refused.is_err() && upd.ended.is_empty());
    let upd = common::apply(&mut s, &pending, |_| vec![7]);
    assert_eq!(upd.ended, [error_end("a")]);
    assert_eq!(upd.updates.len(), 1, "b's tokens, in the same update");
    // A resumed request past the pool, with nothing running: ended at admission.
    let mut s = small_pool();
    common::add(&mut s, "c", 60, 20);
    for _ in 0..5 {
        step(&mut s);
    }
    s.preempt_all_running(false).unwrap();
    let out = common::schedule(&mut s);
    assert_eq!(
        (out.num_reqs(), out.finished_req_ids.clone()),
        (0, vec!["c".to_owned()])
    );
    let mut upd = UpdateOutput::default();
    s.update_from_output(out.step_id, &[], &[], &mut upd)
        .unwrap();
    assert_eq!(upd.ended, [error_end("c")]);
    assert_eq!(s.num_unfinished(), 0);
}

fn legal_config() -> impl Strategy<Value = SchedulerConfig> {
    (
        prop::sample::select(vec![1usize, 3, 4, 16]),
        2usize..80,
        0usize..8,
        prop::sample::select(vec![
            SpecMethod::None,
            SpecMethod::Eagle,
            SpecMethod::DFlash,
        ]),
        1usize..5,
        1usize..4,
    )
        .prop_map(|(bs, max_model_len, spare_blocks, method, k, seqs)| {
            let num_blocks = max_model_len.div_ceil(bs) + 1 + spare_blocks;
            let mut c = SchedulerConfig::new(num_blocks, bs, max_model_len, seqs, 64);
            c.spec_method = method;
            c.num_speculative_tokens = if method == SpecMethod::None { 0 } else { k };
            c
        })
}

// Once the pool holds one max_model_len request, no request is ever ended by the scheduler:
// whatever the prompts (up to max_model_len), every request runs to a normal finish.
proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn a_legal_pool_never_ends_a_request_with_an_error(
        config in legal_config(),
        prompts in prop::collection::vec((1usize..80, 1usize..40), 1..6),
    ) {
        let max_model_len = config.max_model_len;
        let mut s = Scheduler::new(config).unwrap();
        for (i, &(len, max_tokens)) in prompts.iter().enumerate() {
            common::add(&mut s, &format!("r{i}"), len.min(max_model_len), max_tokens);
        }
        let mut finished = 0;
        for _ in 0..2000 {
            if s.num_unfinished() == 0 {
                break;
            }
            let out = common::schedule(&mut s);
            let upd = common::apply(&mut s, &out, |_| vec![7]);
            prop_assert!(upd.ended.is_empty(), "{:?}", upd.ended);
            for u in &upd.updates {
                if let Some(reason) = u.finish_reason {
                    prop_assert!(reason != FinishReason::Error);
                    finished += 1;
                }
            }
        }
        prop_assert_eq!(s.num_unfinished(), 0);
        prop_assert_eq!(finished, prompts.len());
    }
}
