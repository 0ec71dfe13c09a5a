//! vLLM 0.33's pause states and `reset_prefix_cache(reset_running_requests=True)`:
//! `Scheduler::set_pause_state`, `Scheduler::preempt_all_running` and
//! `Scheduler::reset_prefix_cache_preempting_running`, in sync and async mode, with steps in
//! flight whose outputs arrive after the preemption (dropped, or delivered as stale output), and
//! (proptest) `check_invariants` plus the ownership contract after every call.

use std::collections::{HashSet, VecDeque};

mod common;

use common::{add, apply, check_ownership, ids, req, schedule, workload, Workload};
use dflash_core::{
    EntryKind, FinishReason, PauseState, RequestStatus, Scheduler, SchedulerConfig, SpecMethod,
    StepOutput, UpdateOutput,
};
use proptest::prelude::*;

const BS: usize = 16;

fn config(
    method: SpecMethod,
    k: usize,
    num_blocks: usize,
    async_scheduling: bool,
) -> SchedulerConfig {
    // max_model_len: at most what the pool holds (a smaller pool is refused).
    let max_model_len = 256.min((num_blocks - 1) * BS);
    let mut c = SchedulerConfig::new(num_blocks, BS, max_model_len, 8, 128);
    c.spec_method = method;
    c.num_speculative_tokens = k;
    c.async_scheduling = async_scheduling;
    c
}

fn running_ids(s: &Scheduler) -> Vec<String> {
    ids(s, s.running())
}

fn waiting_ids(s: &Scheduler) -> Vec<String> {
    ids(s, &s.waiting_in_order())
}

fn step_ids(s: &Scheduler, out: &StepOutput) -> Vec<String> {
    ids(s, &out.slots)
}

/// The speculative-decoding counters (what vLLM's SpecDecodingStats are made of).
fn spec_stats(s: &Scheduler) -> (u64, u64, u64, Vec<u64>) {
    let st = s.stats();
    (
        st.num_drafts,
        st.num_draft_tokens,
        st.num_accepted_tokens,
        st.num_accepted_tokens_per_pos.clone(),
    )
}

/// Three requests past their prefill and decoding (sync mode, no step in flight).
fn three_decoding(method: SpecMethod, k: usize, async_scheduling: bool) -> Scheduler {
    let mut s = Scheduler::new(config(method, k, 64, async_scheduling)).unwrap();
    add(&mut s, "a", 20, 50);
    add(&mut s, "b", 30, 50);
    add(&mut s, "c", 25, 50);
    s
}

// ------------------------------------------------------------------------------------------
// preempt_all_running / reset_prefix_cache_preempting_running, sync mode

#[test]
fn reset_preempts_in_reverse_running_order_and_resumes_in_fifo_order() {
    let mut s = three_decoding(SpecMethod::DFlash, 3, false);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    assert_eq!(running_ids(&s), ["a", "b", "c"]);
    add(&mut s, "w", 10, 5); // waits behind them
    assert!(!s.reset_prefix_cache(), "blocks are held");

    let preempted = s.reset_prefix_cache_preempting_running().unwrap();
    s.check_invariants().unwrap();
    // vLLM: `while self.running: self._preempt_request(self.running.pop(), ...)`.
    assert_eq!(preempted, ["c", "b", "a"]);
    assert!(s.running().is_empty());
    assert_eq!(waiting_ids(&s), ["a", "b", "c", "w"]);
    assert_eq!(s.kv().num_free_blocks(), s.kv().pool().num_usable_blocks());
    assert_eq!(s.stats().num_preemptions, 3);
    for id in ["a", "b", "c"] {
        let r = req(&s, id);
        assert_eq!(r.status, RequestStatus::Preempted);
        assert_eq!((r.num_computed_tokens, r.num_preemptions), (0, 1));
        assert!(r.spec_token_ids.is_empty() && r.blocks.block_ids.is_empty());
        assert_eq!(r.num_tokens(), r.num_prompt_tokens() + 1); // its output is kept
    }
    // The cache is empty: the resumes recompute everything, in FIFO order.
    let s1 = schedule(&mut s);
    let mut reported = s1.preempted_req_ids.clone();
    reported.sort();
    assert_eq!(reported, ["a", "b", "c"]);
    assert_eq!(step_ids(&s, &s1)[..3], ["a", "b", "c"]);
    assert_eq!(&s1.kinds[..3], &[EntryKind::Resumed; 3]);
    assert_eq!(&s1.num_computed_tokens[..3], &[0, 0, 0]);
    assert_eq!(running_ids(&s)[..3], ["a", "b", "c"]);
    // Reported once.
    apply(&mut s, &s1, |_| vec![51]);
    assert!(schedule(&mut s).preempted_req_ids.is_empty());
}

#[test]
fn reset_with_nothing_running_only_resets() {
    let mut s = three_decoding(SpecMethod::None, 0, false);
    assert!(s
        .reset_prefix_cache_preempting_running()
        .unwrap()
        .is_empty());
    assert_eq!(waiting_ids(&s), ["a", "b", "c"]);
    assert!(schedule(&mut s).preempted_req_ids.is_empty());
}

#[test]
fn sync_step_in_flight_at_reset_is_dropped_and_the_requests_resume_at_once() {
    let mut s = three_decoding(SpecMethod::DFlash, 3, false);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    s.update_draft_token_ids([("a", &[60u32, 61, 62][..])])
        .unwrap();
    let s1 = schedule(&mut s); // a verifies three drafts; b and c decode
    assert_eq!(s1.total_num_scheduled_tokens, 4 + 1 + 1);
    let tokens: Vec<usize> = ["a", "b", "c"]
        .iter()
        .map(|id| req(&s, id).num_tokens())
        .collect();
    let stats = spec_stats(&s);

    s.reset_prefix_cache_preempting_running().unwrap();
    // Dropped output delivers nothing, so the requests do not wait for it.
    let s2 = schedule(&mut s);
    assert_eq!(&s2.kinds[..], &[EntryKind::Resumed; 3]);
    let a = s1
        .slots
        .iter()
        .position(|&x| x == s.slot_of("a").unwrap())
        .unwrap();
    let upd = apply(&mut s, &s1, |i| {
        if i == a {
            vec![60, 61, 70]
        } else {
            vec![70]
        }
    });
    assert!(upd.updates.is_empty() && upd.new_token_ids.is_empty());
    for (id, n) in ["a", "b", "c"].iter().zip(&tokens) {
        assert_eq!(req(&s, id).num_tokens(), *n, "{id}");
    }
    // No draft was verified as far as the stats go.
    assert_eq!(spec_stats(&s), stats);
    let upd = apply(&mut s, &s2, |_| vec![71]);
    assert_eq!(upd.updates.len(), 3);
    assert_eq!(req(&s, "a").num_tokens(), tokens[0] + 1);
}

#[test]
fn without_drop_the_stale_output_is_delivered_and_awaited() {
    let mut s = three_decoding(SpecMethod::None, 0, false);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    let s1 = schedule(&mut s);
    let preempted = s.preempt_all_running(false).unwrap();
    assert_eq!(preempted, ["c", "b", "a"]);
    s.check_invariants().unwrap();
    // Their stale output is still in flight: passed over, nothing to schedule.
    let s2 = schedule(&mut s);
    assert_eq!(s2.num_reqs(), 0);
    assert_eq!(s2.preempted_req_ids.len(), 3);
    let upd = apply(&mut s, &s1, |_| vec![52]);
    assert_eq!(upd.updates.len(), 3); // delivered, as for any ordinary preemption
    assert_eq!(req(&s, "a").num_tokens(), 20 + 2);
    assert_eq!(req(&s, "a").num_computed_tokens, 0);
    let s3 = schedule(&mut s);
    assert_eq!(step_ids(&s, &s3), ["a", "b", "c"]);
}

#[test]
fn a_request_finished_after_the_reset_is_reported_both_ways() {
    let mut s = three_decoding(SpecMethod::None, 0, false);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    s.reset_prefix_cache_preempting_running().unwrap();
    s.finish_requests(["b"], FinishReason::Abort).unwrap();
    s.check_invariants().unwrap();
    let s1 = schedule(&mut s);
    assert_eq!(s1.finished_req_ids, ["b"]);
    assert!(s1.preempted_req_ids.contains(&"b".to_owned()));
    assert_eq!(step_ids(&s, &s1), ["a", "c"]);
}

// ------------------------------------------------------------------------------------------
// async mode: outputs of up to three steps in flight arrive after the reset

#[test]
fn async_reset_drops_every_step_in_flight() {
    let mut s = three_decoding(SpecMethod::DFlash, 3, true);
    let s0 = schedule(&mut s);
    let s1 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    let s2 = schedule(&mut s); // s1 and s2 in flight, 1 + K placeholders each
    assert_eq!(req(&s, "a").num_output_placeholders, 8);
    let tokens: Vec<usize> = ["a", "b", "c"]
        .iter()
        .map(|id| req(&s, id).num_tokens())
        .collect();
    let stats = spec_stats(&s);

    s.reset_prefix_cache_preempting_running().unwrap();
    for id in ["a", "b", "c"] {
        let r = req(&s, id);
        assert_eq!((r.num_computed_tokens, r.num_output_placeholders), (0, 0));
        assert!(r.num_in_flight_tokens > 0);
    }
    // Resumed at once (not passed over), recomputing their known tokens.
    let s3 = schedule(&mut s);
    assert_eq!(step_ids(&s, &s3), ["a", "b", "c"]);
    assert_eq!(
        s3.num_scheduled_tokens,
        tokens.iter().map(|&n| n as i32).collect::<Vec<_>>()
    );
    for out in [&s1, &s2] {
        let upd = apply(&mut s, out, |_| vec![60, 61]);
        assert!(upd.updates.is_empty());
    }
    assert_eq!(spec_stats(&s), stats);
    for (id, n) in ["a", "b", "c"].iter().zip(&tokens) {
        let r = req(&s, id);
        assert_eq!(r.num_tokens(), *n);
        // Only s3's placeholder is left (the resume samples one token, no drafts).
        assert_eq!((r.num_output_placeholders, r.num_in_flight_tokens), (1, *n));
    }
    let upd = apply(&mut s, &s3, |_| vec![62]);
    assert_eq!(upd.updates.len(), 3);
    assert_eq!(req(&s, "a").num_tokens(), tokens[0] + 1);
}

#[test]
fn async_empty_sample_of_a_dropped_entry_is_accepted() {
    let mut s = three_decoding(SpecMethod::Ngram, 3, true);
    let s0 = schedule(&mut s);
    s.reset_prefix_cache_preempting_running().unwrap();
    // A sampling entry must sample a token, except when its output is dropped anyway.
    let upd = apply(&mut s, &s0, |_| Vec::new());
    assert!(upd.updates.is_empty());
}

#[test]
fn a_later_preemption_keeps_dropping_while_dropped_output_is_in_flight() {
    // vLLM: `drop_stale_output = drop or (drop_stale_output and num_stale_output_tokens > 0)`.
    let mut s = three_decoding(SpecMethod::None, 0, true);
    let s0 = schedule(&mut s);
    s.reset_prefix_cache_preempting_running().unwrap();
    let s1 = schedule(&mut s); // resumed; s0 (dropped) still in flight
    assert_eq!(s1.num_reqs(), 3);
    // An ordinary preemption now: s0 is undrained, so s1's output is dropped too.
    s.preempt_all_running(false).unwrap();
    s.check_invariants().unwrap();
    let s2 = schedule(&mut s); // and they resume at once
    assert_eq!(s2.num_reqs(), 3);
    assert!(apply(&mut s, &s0, |_| vec![40]).updates.is_empty());
    assert!(apply(&mut s, &s1, |_| vec![41]).updates.is_empty());
    assert_eq!(apply(&mut s, &s2, |_| vec![42]).updates.len(), 3);
    assert_eq!(req(&s, "a").num_tokens(), 21);
}

#[test]
fn a_later_preemption_after_the_dropped_output_drained_delivers() {
    let mut s = three_decoding(SpecMethod::None, 0, true);
    let s0 = schedule(&mut s);
    s.reset_prefix_cache_preempting_running().unwrap();
    let s1 = schedule(&mut s);
    assert!(apply(&mut s, &s0, |_| vec![40]).updates.is_empty());
    s.preempt_all_running(false).unwrap();
    s.check_invariants().unwrap();
    // s1's output is ordinary stale output: awaited, then delivered.
    assert_eq!(schedule(&mut s).num_reqs(), 0);
    let upd = apply(&mut s, &s1, |_| vec![41]);
    assert_eq!(upd.updates.len(), 3);
    assert_eq!(req(&s, "a").num_tokens(), 21);
    assert_eq!(req(&s, "a").num_computed_tokens, 0);
}

#[test]
fn a_request_reset_twice_drops_both_shares() {
    let mut s = three_decoding(SpecMethod::Eagle, 2, true);
    let s0 = schedule(&mut s);
    s.reset_prefix_cache_preempting_running().unwrap();
    let s1 = schedule(&mut s);
    s.reset_prefix_cache_preempting_running().unwrap();
    let s2 = schedule(&mut s);
    assert_eq!(req(&s, "b").num_preemptions, 2);
    for out in [&s0, &s1] {
        assert!(apply(&mut s, out, |_| vec![7]).updates.is_empty());
    }
    assert_eq!(apply(&mut s, &s2, |_| vec![8]).updates.len(), 3);
}

// ------------------------------------------------------------------------------------------
// pause states

#[test]
fn paused_new_schedules_running_requests_and_admits_nobody() {
    let mut s = Scheduler::new(config(SpecMethod::DFlash, 3, 64, false)).unwrap();
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![50]);
    add(&mut s, "new", 10, 5);
    s.set_pause_state(PauseState::PausedNew);
    assert_eq!(s.pause_state(), PauseState::PausedNew);
    for _ in 0..3 {
        let out = schedule(&mut s);
        assert_eq!(step_ids(&s, &out), ["a"]);
        apply(&mut s, &out, |_| vec![51]);
    }
    // Preempted requests are in the waiting queue too: not resumed while paused.
    s.preempt_all_running(false).unwrap();
    let out = schedule(&mut s);
    assert_eq!(out.num_reqs(), 0);
    assert_eq!(out.preempted_req_ids, ["a"]);
    assert_eq!(waiting_ids(&s), ["a", "new"]);
    s.set_pause_state(PauseState::Unpaused);
    let out = schedule(&mut s);
    assert_eq!(step_ids(&s, &out), ["a", "new"]);
}

#[test]
fn paused_all_schedules_nothing_but_reports_finished_and_preempted_ids() {
    let mut s = three_decoding(SpecMethod::None, 0, true);
    let s0 = schedule(&mut s);
    s.set_pause_state(PauseState::PausedAll);
    let s1 = schedule(&mut s);
    assert_eq!((s1.num_reqs(), s1.total_num_scheduled_tokens), (0, 0));
    assert_eq!(s1.step_id, s0.step_id + 1);
    // The output of the step in flight still applies.
    assert_eq!(apply(&mut s, &s0, |_| vec![9]).updates.len(), 3);
    apply(&mut s, &s1, |_| Vec::new());
    s.finish_requests(["b"], FinishReason::Abort).unwrap();
    s.reset_prefix_cache_preempting_running().unwrap();
    let s2 = schedule(&mut s);
    assert_eq!(s2.num_reqs(), 0);
    assert_eq!(s2.finished_req_ids, ["b"]);
    let mut preempted = s2.preempted_req_ids.clone();
    preempted.sort();
    assert_eq!(preempted, ["a", "c"]);
    assert_eq!(waiting_ids(&s), ["a", "c"]);
    s.set_pause_state(PauseState::Unpaused);
    let s3 = schedule(&mut s);
    assert_eq!(step_ids(&s, &s3), ["a", "c"]);
}

#[test]
fn pause_state_names_round_trip() {
    for p in [
        PauseState::Unpaused,
        PauseState::PausedNew,
        PauseState::PausedAll,
    ] {
        assert_eq!(PauseState::from_name(p.name()).unwrap(), p);
    }
    let err = PauseState::from_name("paused").unwrap_err();
    assert!(err.to_string().contains("\"paused_new\""), "{err}");
}

// ------------------------------------------------------------------------------------------
// property test: invariants, ownership and dropped outputs with resets and pauses

/// Ownership, invariants and the pause state's rules for a step just scheduled.
fn check_scheduled(
    s: &Scheduler,
    out: &StepOutput,
    pause: PauseState,
    waiting_before: usize,
) -> Result<(), String> {
    check_ownership(s, out)?;
    s.check_invariants().map_err(|e| e.to_string())?;
    let admitted = out
        .kinds
        .iter()
        .filter(|k| **k != EntryKind::Running)
        .count();
    if pause != PauseState::Unpaused && admitted > 0 {
        return Err(format!("{pause:?} admitted {admitted} requests"));
    }
    if pause == PauseState::PausedAll && (out.num_reqs() > 0 || s.num_waiting() < waiting_before) {
        return Err("PausedAll scheduled something".into());
    }
    Ok(())
}

/// Returns (resets, entries whose output was dropped).
fn run(w: &Workload) -> Result<(usize, usize), String> {
    let e = |e: dflash_core::CoreError| e.to_string();
    let mut s =
        Scheduler::new(config(w.method, w.k, w.num_blocks, w.async_scheduling)).map_err(e)?;
    for (i, &(len, max_tokens)) in w.prompts.iter().enumerate() {
        add(&mut s, &format!("r{i}"), len, max_tokens);
    }
    let mut rng = common::rng(w.seed);
    let mut in_flight: VecDeque<StepOutput> = Default::default();
    // (step id, slot, generation) of entries whose output must be dropped.
    let mut dropped: HashSet<(u64, u32, u32)> = HashSet::new();
    let mut upd = UpdateOutput::default();
    let mut resets = 0;
    for _ in 0..800 {
        match rng.next_u32() % 50 {
            0 | 1 => {
                let drop = rng.next_u32() % 2 == 0;
                let running: Vec<(u32, u32)> = s
                    .running()
                    .iter()
                    .map(|&slot| (slot, s.requests().generation(slot)))
                    .collect();
                if drop {
                    for out in &in_flight {
                        for (i, &slot) in out.slots.iter().enumerate() {
                            if running.contains(&(slot, out.generations[i])) {
                                dropped.insert((out.step_id, slot, out.generations[i]));
                            }
                        }
                    }
                    s.reset_prefix_cache_preempting_running().map_err(e)?;
                    resets += 1;
                } else {
                    s.preempt_all_running(false).map_err(e)?;
                }
                if !s.running().is_empty() {
                    return Err("requests still running after preempt_all_running".into());
                }
                s.check_invariants().map_err(e)?;
            }
            2 => s.set_pause_state(PauseState::PausedNew),
            3 => s.set_pause_state(PauseState::PausedAll),
            4..=7 => s.set_pause_state(PauseState::Unpaused),
            _ => {}
        }
        if s.num_unfinished() > 0 && in_flight.len() < w.in_flight {
            let mut out = StepOutput::default();
            let waiting_before = s.num_waiting();
            let pause = s.pause_state();
            match s.schedule(&mut out) {
                // An idle step at the in-flight limit is refused: apply the oldest output.
                Err(dflash_core::CoreError::State(_))
                    if in_flight.iter().filter(|o| o.num_reqs() > 0).count()
                        >= s.max_steps_in_flight() => {}
                result => {
                    result.map_err(e)?;
                    check_scheduled(&s, &out, pause, waiting_before)?;
                    in_flight.push_back(out);
                    if in_flight.len() < w.in_flight {
                        continue;
                    }
                }
            }
        }
        let Some(out) = in_flight.pop_front() else {
            if s.num_unfinished() == 0 {
                break;
            }
            s.set_pause_state(PauseState::Unpaused); // the engine would wait for a resume
            continue;
        };
        if rng.next_u32() % 40 == 0 {
            let id = format!("r{}", rng.next_u32() as usize % w.prompts.len());
            s.finish_requests([id.as_str()], FinishReason::Abort)
                .map_err(e)?;
            s.check_invariants().map_err(e)?;
        }
        let (tokens, counts) = common::random_output(&out, &mut rng, |r| r.next_u32() % 200 + 2);
        s.update_from_output(out.step_id, &tokens, &counts, &mut upd)
            .map_err(e)?;
        s.check_invariants().map_err(e)?;
        for u in &upd.updates {
            let i = out.slots.iter().position(|&x| x == u.slot).unwrap();
            if dropped.contains(&(out.step_id, u.slot, out.generations[i])) {
                return Err(format!(
                    "step {}: a dropped output was delivered",
                    out.step_id
                ));
            }
        }
    }
    if s.num_unfinished() > 0 || !in_flight.is_empty() {
        return Err(format!(
            "{} requests unfinished, {} steps in flight, {resets} resets",
            s.num_unfinished(),
            in_flight.len()
        ));
    }
    Ok((resets, dropped.len()))
}

#[test]
fn the_property_test_resets_with_outputs_in_flight() {
    let (mut resets, mut dropped) = (0, 0);
    for seed in 0..8 {
        let w = Workload {
            method: SpecMethod::DFlash,
            k: 3,
            num_blocks: 24,
            async_scheduling: seed % 2 == 0,
            in_flight: 1 + seed as usize % 3,
            prompts: (0..10).map(|i| (10 + 13 * i, 5 + 7 * i)).collect(),
            seed,
        };
        let (r, d) = run(&w).unwrap();
        resets += r;
        dropped += d;
    }
    assert!(
        resets >= 8 && dropped >= 8,
        "{resets} resets, {dropped} dropped"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn invariants_hold_through_resets_and_pauses(w in workload(4, 12, 0.5)) {
        let result = run(&w);
        prop_assert!(result.is_ok(), "{:?}", result);
    }
}
