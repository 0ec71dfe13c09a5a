//! Async scheduling (vLLM's `AsyncScheduler`): a step is scheduled before the previous step's
//! output is applied. Placeholder bookkeeping with two steps in flight, rejected drafts, a stop
//! and a preemption while a step is in flight, and (proptest) the ownership contract,
//! `check_invariants` and the held block-table snapshots after every call with up to three steps
//! in flight.

mod common;

use common::{add, apply, check_ownership, req, schedule, workload, Workload};
use dflash_core::{
    CoreError, FinishReason, RequestStatus, Scheduler, SchedulerConfig, SnapshotPool, SpecMethod,
    StepOutput, TableSnapshot, UpdateOutput, PLACEHOLDER_TOKEN,
};
use proptest::prelude::*;
use std::sync::Arc;

const BS: usize = 16;

fn config(method: SpecMethod, k: usize, num_blocks: usize) -> SchedulerConfig {
    // max_model_len: at most what the pool holds (a smaller pool is refused).
    let max_model_len = 256.min((num_blocks - 1) * BS);
    let mut c = SchedulerConfig::new(num_blocks, BS, max_model_len, 8, 128);
    c.spec_method = method;
    c.num_speculative_tokens = k;
    c.async_scheduling = true;
    c
}

fn index(s: &Scheduler, out: &StepOutput, id: &str) -> usize {
    let slot = s.slot_of(id).unwrap();
    out.slots.iter().position(|&x| x == slot).unwrap()
}

fn spec_of(out: &StepOutput, i: usize) -> &[u32] {
    let start: u32 = out.num_spec_tokens[..i].iter().sum();
    &out.spec_token_ids[start as usize..(start + out.num_spec_tokens[i]) as usize]
}

#[test]
fn two_steps_in_flight_count_placeholders() {
    let mut s = Scheduler::new(config(SpecMethod::DFlash, 3, 64)).unwrap();
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    assert_eq!(s0.num_scheduled_tokens, vec![20]);
    let r = req(&s, "a");
    // The prefill samples one token: a placeholder, and K placeholder drafts for the next step.
    assert_eq!((r.num_computed_tokens, r.num_output_placeholders), (20, 1));
    assert_eq!(r.spec_token_ids.as_slice(), &[PLACEHOLDER_TOKEN; 3]);
    assert!(!r.is_prefill_chunk);

    // Step 1 before step 0's output: 1 + K tokens on top of the placeholder.
    let s1 = schedule(&mut s);
    assert_eq!(s1.num_scheduled_tokens, vec![4]);
    assert_eq!(s1.num_computed_tokens, vec![20]);
    assert_eq!(s1.num_output_placeholders, vec![1]);
    assert_eq!(spec_of(&s1, 0), &[PLACEHOLDER_TOKEN; 3]);
    let r = req(&s, "a");
    assert_eq!((r.num_computed_tokens, r.num_output_placeholders), (24, 5));
    assert_eq!(r.num_in_flight_tokens, 24);
    // Ownership: positions up to 24 + K + 1 = 28 lie in the request's blocks.
    assert!(r.blocks.block_ids.len() * BS >= 28);

    apply(&mut s, &s0, |_| vec![7]);
    let r = req(&s, "a");
    assert_eq!((r.num_tokens(), r.num_computed_tokens), (21, 24));
    assert_eq!((r.num_output_placeholders, r.num_in_flight_tokens), (4, 4));

    // Step 1 accepts one draft of three: two rejected roll back computed and placeholders.
    apply(&mut s, &s1, |_| vec![8, 9]);
    let r = req(&s, "a");
    assert_eq!((r.num_tokens(), r.num_computed_tokens), (23, 22));
    assert_eq!((r.num_output_placeholders, r.num_in_flight_tokens), (0, 0));
}

#[test]
fn rejected_drafts_resolve_placeholders_in_steady_state() {
    let mut s = Scheduler::new(config(SpecMethod::Eagle, 4, 64)).unwrap();
    add(&mut s, "a", 10, 200);
    let mut in_flight = std::collections::VecDeque::new();
    in_flight.push_back(schedule(&mut s));
    for step in 0..30usize {
        in_flight.push_back(schedule(&mut s));
        let out = in_flight.pop_front().unwrap();
        let accepted = step % 5; // 0..=4 of the K = 4 drafts
        let n = out.num_spec_tokens[0] as usize;
        apply(&mut s, &out, |_| vec![100; accepted.min(n) + 1]);
        let r = req(&s, "a");
        // One step in flight: it counts 1 + K placeholders, already in num_computed_tokens.
        let pending = in_flight.back().unwrap();
        assert_eq!(
            r.num_output_placeholders,
            pending.num_scheduled_tokens[0] as usize
        );
        assert_eq!(
            r.num_computed_tokens + 1,
            r.num_tokens() + r.num_output_placeholders
        );
    }
}

#[test]
fn the_skip_rule_stops_scheduling_at_max_tokens() {
    // vLLM's test_stop_by_max_tokens: without drafts, a request is scheduled for exactly
    // prompt + max_tokens - 1 tokens in all, even with a step always in flight.
    let mut s = Scheduler::new(config(SpecMethod::None, 0, 64)).unwrap();
    add(&mut s, "a", 10, 6);
    let mut total = 0;
    let mut in_flight = std::collections::VecDeque::new();
    let mut got = Vec::new();
    for _ in 0..20 {
        if s.num_unfinished() > 0 {
            let out = schedule(&mut s);
            total += out.total_num_scheduled_tokens;
            in_flight.push_back(out);
            if in_flight.len() < 2 {
                continue;
            }
        }
        let Some(out) = in_flight.pop_front() else {
            break;
        };
        let upd = apply(&mut s, &out, |_| vec![50]);
        got.extend(upd.updates.iter().map(|u| u.finish_reason));
    }
    assert_eq!(total, 10 + 6 - 1);
    assert_eq!(got.len(), 6);
    assert_eq!(got.last(), Some(&Some(FinishReason::Length)));
    assert_eq!(s.num_unfinished(), 0);
}

#[test]
fn a_stop_while_a_step_is_in_flight_drops_that_step() {
    let mut s = Scheduler::new(config(SpecMethod::DFlash, 3, 64)).unwrap();
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    let s1 = schedule(&mut s);
    let free_before = s.kv().num_free_blocks();
    let upd = apply(&mut s, &s0, |_| vec![2]); // EOS
    assert_eq!(upd.updates[0].finish_reason, Some(FinishReason::Stop));
    assert!(s.slot_of("a").is_none());
    assert!(s.kv().num_free_blocks() > free_before);
    // Step 1's output arrives for a request that is gone: ignored.
    let upd = apply(&mut s, &s1, |_| vec![5, 6]);
    assert!(upd.updates.is_empty());
    let s2 = schedule(&mut s);
    assert_eq!(s2.num_reqs(), 0);
    assert_eq!(s2.finished_req_ids, vec!["a".to_owned()]);
}

#[test]
fn an_abort_while_a_step_is_in_flight() {
    let mut s = Scheduler::new(config(SpecMethod::Ngram, 3, 64)).unwrap();
    add(&mut s, "a", 20, 50);
    add(&mut s, "b", 20, 50);
    let s0 = schedule(&mut s);
    let s1 = schedule(&mut s);
    s.finish_requests(["a"], FinishReason::Abort).unwrap();
    s.check_invariants().unwrap();
    apply(&mut s, &s0, |_| vec![30]);
    let upd = apply(&mut s, &s1, |_| vec![31]);
    assert_eq!(upd.updates.len(), 1); // b only
    assert_eq!(req(&s, "b").num_tokens(), 22);
}

/// Two prompts that fill 4 blocks each (with DFlash's K + 1 = 4 lookahead slots) in a pool
/// of 8 usable blocks: the second is preempted while its prefill step is in flight, when the
/// first needs a fifth block for its first decode step.
fn preempting_scheduler() -> Scheduler {
    let mut s = Scheduler::new(config(SpecMethod::DFlash, 3, 9)).unwrap();
    add(&mut s, "a", 60, 100);
    add(&mut s, "b", 60, 100);
    s
}

#[test]
fn a_preemption_while_a_step_is_in_flight_makes_its_output_stale() {
    let mut s = preempting_scheduler();
    let s0 = schedule(&mut s);
    assert_eq!(s0.num_reqs(), 2);
    let mut preempted = None;
    let mut pending = s0;
    for _ in 0..10 {
        let next = schedule(&mut s);
        if !next.preempted_req_ids.is_empty() {
            preempted = Some((pending, next));
            break;
        }
        apply(&mut s, &pending, |_| vec![40]);
        pending = next;
    }
    let (stale, next) = preempted.expect("the pool runs out");
    assert_eq!(next.preempted_req_ids, vec!["b".to_owned()]);
    let b = req(&s, "b");
    assert_eq!(b.status, RequestStatus::Preempted);
    assert_eq!((b.num_computed_tokens, b.num_output_placeholders), (0, 0));
    assert!(b.num_in_flight_tokens > 0);
    assert!(b.blocks.block_ids.is_empty());
    let tokens_before = b.num_tokens();
    // The stale output still delivers b's token (as vLLM 0.33 does) but touches no counter.
    let i = index(&s, &stale, "b");
    let upd = apply(&mut s, &stale, |j| if j == i { vec![41] } else { vec![43] });
    assert!(upd
        .updates
        .iter()
        .any(|u| u.slot == s.slot_of("b").unwrap()));
    let b = req(&s, "b");
    assert_eq!(b.num_tokens(), tokens_before + 1);
    assert_eq!((b.num_computed_tokens, b.num_output_placeholders), (0, 0));
    assert_eq!(b.num_in_flight_tokens, 0);
    apply(&mut s, &next, |_| vec![44]);
}

#[test]
fn a_preempted_request_is_passed_over_while_its_stale_output_is_in_flight() {
    // Three steps in flight: when b is preempted in step 1, its step 0 is still in flight at
    // the schedule() of step 2. As in vLLM 0.33, b is passed over there (it keeps its place at
    // the head of the queue): c, queued behind it, is admitted; strict FCFS would stop at b.
    let mut s = preempting_scheduler();
    add(&mut s, "c", 20, 3);
    let s0 = schedule(&mut s);
    assert_eq!(s0.num_reqs(), 2); // c does not fit yet
    let s1 = schedule(&mut s);
    assert_eq!(s1.preempted_req_ids, vec!["b".to_owned()]);
    assert!(req(&s, "b").num_in_flight_tokens > 0);
    let s2 = schedule(&mut s);
    let (b, c) = (s.slot_of("b").unwrap(), s.slot_of("c").unwrap());
    assert!(!s2.slots.contains(&b) && s2.slots.contains(&c));
    assert_eq!(s.waiting_in_order(), vec![b]);
    // Once the stale output has arrived, b is a candidate again.
    apply(&mut s, &s0, |_| vec![45]);
    assert_eq!(req(&s, "b").num_in_flight_tokens, 0);
    apply(&mut s, &s1, |_| vec![46]);
    apply(&mut s, &s2, |_| vec![47]);
}

#[test]
fn an_empty_sample_for_a_sampling_entry_is_refused_and_changes_nothing() {
    let mut s = Scheduler::new(config(SpecMethod::DFlash, 3, 64)).unwrap();
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    let before = (
        req(&s, "a").num_computed_tokens,
        req(&s, "a").num_output_placeholders,
    );
    let mut upd = UpdateOutput::default();
    let err = s
        .update_from_output(s0.step_id, &[], &[0], &mut upd)
        .unwrap_err();
    assert!(err.to_string().contains("sampled no token"), "{err}");
    let after = (
        req(&s, "a").num_computed_tokens,
        req(&s, "a").num_output_placeholders,
    );
    assert_eq!(before, after);
    apply(&mut s, &s0, |_| vec![9]);
}

#[test]
fn without_async_mode_a_step_in_flight_blocks_the_next_decode() {
    // The contrast that makes placeholders necessary: in sync mode the next schedule() finds
    // nothing to compute for a request whose decode step is in flight, and says so.
    let mut c = config(SpecMethod::DFlash, 3, 64);
    c.async_scheduling = false;
    let mut s = Scheduler::new(c).unwrap();
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    let err = s.schedule(&mut StepOutput::default()).unwrap_err();
    assert!(matches!(err, CoreError::State(_)), "{err}");
    assert!(err.to_string().contains("step 0 (1 requests)"), "{err}");
    assert_eq!(req(&s, "a").num_output_placeholders, 0);
    apply(&mut s, &s0, |_| vec![9]);
}

// ------------------------------------------------------------------------------------------
// property test: ownership and invariants with up to three steps in flight, lost steps included

/// What the scheduler's callers can observe: counters, queues and every request's progress.
fn state_of(s: &Scheduler) -> String {
    let requests: Vec<String> = s
        .requests()
        .iter()
        .map(|(slot, r)| {
            format!(
                "{slot}:{:?}/{}/{}/{}/{:?}/{:?}",
                r.status,
                r.num_computed_tokens,
                r.num_output_placeholders,
                r.num_in_flight_tokens,
                r.blocks,
                r.spec_token_ids
            )
        })
        .collect();
    format!(
        "{:?} {:?} {:?} {:?} {} {requests:?}",
        s.stats(),
        s.prefix_cache_stats(),
        s.running(),
        s.waiting_in_order(),
        s.kv().num_free_blocks()
    )
}

/// A step's block table as the bindings hand it out: its version at return time, frozen
/// (made a snapshot) when first read, which may be many calls later.
struct Held {
    version: u64,
    /// Each entry's blocks at return time.
    rows: Vec<Vec<i32>>,
    snapshot: Option<(Arc<TableSnapshot>, Vec<i32>)>,
}

/// A step's table, not read yet: what its rows must read whenever they are.
fn hold(s: &Scheduler, out: &StepOutput) -> Result<Held, String> {
    let rows = out
        .slots
        .iter()
        .map(|&slot| {
            let r = s.requests().get(slot).map_err(|e| e.to_string())?;
            Ok(r.blocks.block_ids.iter().map(|&b| b as i32).collect())
        })
        .collect::<Result<_, String>>()?;
    Ok(Held {
        version: s.block_table().version(),
        rows,
        snapshot: None,
    })
}

/// Reads a held table (first reads freeze it), checks it against its rows and its first read.
fn read(pool: &mut SnapshotPool, s: &Scheduler, h: &mut Held) -> Result<(), String> {
    if h.snapshot.is_none() {
        let snap = pool
            .take(s.block_table(), h.version)
            .map_err(|e| e.to_string())?;
        let copy = snap.as_slice().to_vec();
        h.snapshot = Some((snap, copy));
    }
    let (snap, copy) = h.snapshot.as_ref().expect("read");
    if snap.as_slice() != &copy[..] {
        return Err("a held block-table snapshot changed".into());
    }
    for (i, row) in h.rows.iter().enumerate() {
        if snap.row(i) != &row[..] {
            return Err(format!(
                "row {i} of the table of version {} reads {:?}, not {:?}",
                h.version,
                snap.row(i),
                row
            ));
        }
    }
    Ok(())
}

/// Reads some held tables (the rest stay lazy), drops some, and trims the journal to what
/// the unread ones still need.
fn visit_held(
    pool: &mut SnapshotPool,
    s: &mut Scheduler,
    held: &mut Vec<Held>,
    rng: &mut proptest::test_runner::TestRng,
) -> Result<(), String> {
    for h in held.iter_mut() {
        if h.snapshot.is_some() || rng.next_u32() % 4 == 0 {
            read(pool, s, h)?;
        }
    }
    if held.len() > 6 || (!held.is_empty() && rng.next_u32() % 3 == 0) {
        held.remove(rng.next_u32() as usize % held.len());
    }
    let needed = held
        .iter()
        .filter(|h| h.snapshot.is_none())
        .map(|h| h.version)
        .min()
        .unwrap_or(s.block_table().version());
    if rng.next_u32() % 5 == 0 {
        s.trim_block_table_journal(needed);
    }
    Ok(())
}

/// Every position a scheduled entry writes (scheduled tokens, on top of the placeholders in
/// its computed count, plus the method's lookahead) lies in a block the request owns. Now and
/// then a step's output is lost: the step is abandoned (with the younger ones), and its
/// output is then refused. An idle step asked for at the in-flight limit is refused, changing
/// nothing; the loop then applies the oldest output, as an engine would. Each step's table is
/// held for a while, read (frozen) at a random later call or never, and must read as the
/// entries' blocks at return time; some are let go early, so snapshots get reused.
fn run(w: &Workload) -> Result<(), String> {
    let mut c = config(w.method, w.k, w.num_blocks);
    c.async_scheduling = w.async_scheduling;
    let mut s = Scheduler::new(c).map_err(|e| e.to_string())?;
    for (i, &(len, max_tokens)) in w.prompts.iter().enumerate() {
        add(&mut s, &format!("r{i}"), len, max_tokens);
    }
    let mut rng = common::rng(w.seed);
    let mut in_flight: std::collections::VecDeque<StepOutput> = Default::default();
    let mut upd = UpdateOutput::default();
    let (mut pool, mut held) = (SnapshotPool::new(), Vec::<Held>::new());
    s.enable_block_table_journal();
    for _ in 0..600 {
        visit_held(&mut pool, &mut s, &mut held, &mut rng)?;
        if s.num_unfinished() > 0 && in_flight.len() < w.in_flight {
            let mut out = StepOutput::default();
            let before = state_of(&s);
            match s.schedule(&mut out) {
                Ok(()) => {
                    check_ownership(&s, &out)?;
                    s.check_invariants().map_err(|e| e.to_string())?;
                    held.push(hold(&s, &out)?);
                    in_flight.push_back(out);
                    if in_flight.len() < w.in_flight {
                        continue;
                    }
                }
                Err(CoreError::State(e)) => {
                    let awaiting = in_flight.iter().filter(|o| o.num_reqs() > 0).count();
                    if awaiting < s.max_steps_in_flight() {
                        return Err(format!("idle step refused below the limit: {e}"));
                    }
                    if before != state_of(&s) {
                        return Err(format!("a refused schedule() changed state: {e}"));
                    }
                }
                Err(e) => return Err(e.to_string()),
            }
        }
        let Some(out) = in_flight.pop_front() else {
            break;
        };
        if out.num_reqs() > 0 && rng.next_u32() % 25 == 0 {
            // The runner raised: the step and every younger one are abandoned.
            let n = s.abandon_step(out.step_id).map_err(|e| e.to_string())?;
            let awaiting = 1 + in_flight.iter().filter(|o| o.num_reqs() > 0).count();
            if n != awaiting {
                return Err(format!("abandoned {n} steps, {awaiting} were in flight"));
            }
            s.check_invariants().map_err(|e| e.to_string())?;
            let (tokens, counts) = common::random_output(&out, &mut rng, |_| 9);
            match s.update_from_output(out.step_id, &tokens, &counts, &mut upd) {
                Err(CoreError::State(_)) => {}
                other => return Err(format!("an abandoned step's output gave {other:?}")),
            }
            in_flight.clear();
            continue;
        }
        if rng.next_u32() % 40 == 0 {
            let id = format!("r{}", rng.next_u32() as usize % w.prompts.len());
            s.finish_requests([id.as_str()], FinishReason::Abort)
                .map_err(|e| e.to_string())?;
            s.check_invariants().map_err(|e| e.to_string())?;
        }
        // Token 2 is EOS: some requests stop while a later step is in flight.
        let (tokens, counts) = common::random_output(&out, &mut rng, |r| r.next_u32() % 200 + 2);
        s.update_from_output(out.step_id, &tokens, &counts, &mut upd)
            .map_err(|e| e.to_string())?;
        s.check_invariants().map_err(|e| e.to_string())?;
    }
    if s.num_unfinished() > 0 || !in_flight.is_empty() {
        return Err(format!(
            "{} requests unfinished, {} steps in flight: {}",
            s.num_unfinished(),
            in_flight.len(),
            state_of(&s)
        ));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn ownership_and_invariants_hold_with_steps_in_flight(w in workload(6, 16, 0.75)) {
        let result = run(&w);
        prop_assert!(result.is_ok(), "{:?}", result);
    }
}
