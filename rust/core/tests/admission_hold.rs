//! Admission holds (vLLM's `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`): a held request is passed
//! over at admission and keeps its queue place, counts as a skipped waiting request from the
//! moment it is held until it is admitted or finished, and only the held requests that the
//! admission loop reached are reported as passed over.

mod common;

use common::{add, apply, ids, schedule};
use dflash_core::{CoreError, FinishReason, Policy, Scheduler, SchedulerConfig};

fn scheduler(max_num_seqs: usize, max_num_batched_tokens: usize) -> Scheduler {
    Scheduler::new(SchedulerConfig::new(
        200,
        16,
        512,
        max_num_seqs,
        max_num_batched_tokens,
    ))
    .unwrap()
}

fn passed_over(s: &Scheduler) -> Vec<String> {
    ids(s, s.held_passed_over())
}

#[test]
fn a_held_request_is_passed_over_and_keeps_its_place() {
    let mut s = scheduler(8, 1024);
    for id in ["a", "b", "c", "d"] {
        add(&mut s, id, 20, 4);
    }
    s.set_admission_hold("b", true).unwrap();
    s.set_admission_hold("c", true).unwrap();
    let out = schedule(&mut s);
    assert_eq!(ids(&s, &out.slots), ["a", "d"]);
    assert_eq!(passed_over(&s), ["b", "c"]);
    // Skipped requests go back to the front of the queue, in their order.
    assert_eq!(ids(&s, &s.waiting_in_order()), ["b", "c"]);
    apply(&mut s, &out, |_| vec![100]);
    add(&mut s, "e", 20, 4);
    s.set_admission_hold("c", false).unwrap();
    let out = schedule(&mut s);
    // c is released and admitted ahead of e, which arrived after it; b stays held.
    assert_eq!(ids(&s, &out.slots), ["a", "d", "c", "e"]);
    assert_eq!(passed_over(&s), ["b"]);
    assert_eq!(ids(&s, &s.waiting_in_order()), ["b"]);
}

#[test]
fn held_requests_count_as_skipped_from_the_hold_until_admitted() {
    let mut s = scheduler(8, 1024);
    add(&mut s, "a", 20, 4);
    add(&mut s, "b", 20, 4);
    s.set_admission_hold("b", true).unwrap();
    // vLLM adds a request in a blocked status to deferred_waiting when it is enqueued.
    assert_eq!(s.num_deferred_waiting(), 1);
    s.set_admission_hold("b", true).unwrap();
    assert_eq!(s.num_deferred_waiting(), 1, "holding twice counts once");
    let out = schedule(&mut s);
    apply(&mut s, &out, |_| vec![100]);
    s.set_admission_hold("b", false).unwrap();
    // Released but not admitted yet: still skipped, as vLLM's deferred_waiting.
    assert_eq!(s.num_deferred_waiting(), 1);
    s.check_invariants().unwrap();
    let out = schedule(&mut s);
    assert!(ids(&s, &out.slots).contains(&"b".to_owned()));
    assert_eq!(s.num_deferred_waiting(), 0);
}

#[test]
fn a_finished_held_request_is_no_longer_counted() {
    let mut s = scheduler(8, 1024);
    add(&mut s, "a", 20, 4);
    s.set_admission_hold("a", true).unwrap();
    let done = s.finish_requests(["a"], FinishReason::Error).unwrap();
    assert_eq!(done, ["a"]);
    assert_eq!(s.num_deferred_waiting(), 0);
    assert_eq!(s.num_unfinished(), 0);
    s.check_invariants().unwrap();
}

#[test]
fn only_held_requests_the_loop_reaches_are_passed_over() {
    // One sequence slot: the loop passes over held a, admits b and stops; held c behind b is
    // never reached.
    let mut s = scheduler(1, 1024);
    for id in ["a", "b", "c"] {
        add(&mut s, id, 20, 4);
    }
    s.set_admission_hold("a", true).unwrap();
    s.set_admission_hold("c", true).unwrap();
    let out = schedule(&mut s);
    assert_eq!(ids(&s, &out.slots), ["b"]);
    assert_eq!(passed_over(&s), ["a"]);
    assert_eq!(ids(&s, &s.waiting_in_order()), ["a", "c"]);
    apply(&mut s, &out, |_| vec![100]);
    let out = schedule(&mut s);
    // b fills max_num_seqs: admission does not start, nothing is passed over.
    assert_eq!(ids(&s, &out.slots), ["b"]);
    assert!(passed_over(&s).is_empty());
}

#[test]
fn the_token_budget_stops_the_loop_before_a_held_request() {
    let mut s = scheduler(8, 20);
    add(&mut s, "a", 20, 4);
    add(&mut s, "b", 20, 4);
    s.set_admission_hold("b", true).unwrap();
    let out = schedule(&mut s);
    assert_eq!(ids(&s, &out.slots), ["a"]);
    assert!(
        passed_over(&s).is_empty(),
        "the budget ran out before b was reached"
    );
}

#[test]
fn holds_are_refused_for_unknown_or_admitted_requests() {
    let mut s = scheduler(8, 1024);
    add(&mut s, "a", 20, 4);
    assert!(matches!(
        s.set_admission_hold("zz", true),
        Err(CoreError::UnknownRequest(_))
    ));
    assert!(matches!(
        s.is_admission_held("zz"),
        Err(CoreError::UnknownRequest(_))
    ));
    let out = schedule(&mut s);
    let err = s.set_admission_hold("a", true).unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    // Refused without a change; releasing a request not held is a no-op.
    assert!(!s.is_admission_held("a").unwrap());
    s.set_admission_hold("a", false).unwrap();
    assert_eq!(s.num_deferred_waiting(), 0);
    apply(&mut s, &out, |_| vec![100]);
}

#[test]
fn a_preempted_request_cannot_be_held() {
    // 3 usable blocks of 16: a (31 tokens) and b (15) cannot both grow; b is preempted.
    let mut s = Scheduler::new(SchedulerConfig::new(4, 16, 48, 8, 1024)).unwrap();
    add(&mut s, "a", 31, 20);
    add(&mut s, "b", 15, 20);
    let mut preempted = false;
    for _ in 0..20 {
        let out = schedule(&mut s);
        if !out.preempted_req_ids.is_empty() {
            let victim = out.preempted_req_ids[0].clone();
            let err = s.set_admission_hold(&victim, true).unwrap_err();
            assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
            preempted = true;
            break;
        }
        apply(&mut s, &out, |_| vec![100]);
    }
    assert!(preempted, "the premise: a request was preempted");
}

#[test]
fn priority_policy_passes_over_a_held_request_by_key() {
    let mut c = SchedulerConfig::new(200, 16, 512, 8, 1024);
    c.policy = Policy::Priority;
    let mut s = Scheduler::new(c).unwrap();
    for id in ["a", "b", "c"] {
        add(&mut s, id, 20, 4);
    }
    s.set_admission_hold("a", true).unwrap();
    let out = schedule(&mut s);
    assert_eq!(ids(&s, &out.slots), ["b", "c"]);
    assert_eq!(ids(&s, &s.waiting_in_order()), ["a"]);
    apply(&mut s, &out, |_| vec![100]);
    s.set_admission_hold("a", false).unwrap();
    let out = schedule(&mut s);
    assert_eq!(ids(&s, &out.slots), ["b", "c", "a"]);
}
