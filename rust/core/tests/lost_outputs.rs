//! Outputs that never come right (issue 16, defects 4 and 5): an empty sample for a decode
//! that verified drafts is refused; a lost step is abandoned with `abandon_step` (its requests
//! roll back and are scheduled again); an idle `schedule()` while the step it waits for is in
//! flight is refused instead of returning empty steps forever.

mod common;

use common::{add, apply, req, schedule};
use dflash_core::{
    CoreError, RequestStatus, Scheduler, SchedulerConfig, SpecMethod, StepOutput, UpdateOutput,
};

const BS: usize = 16;

fn scheduler(k: usize, async_scheduling: bool) -> Scheduler {
    let mut c = SchedulerConfig::new(64, BS, 256, 8, 256);
    c.spec_method = SpecMethod::DFlash;
    c.num_speculative_tokens = k;
    c.async_scheduling = async_scheduling;
    Scheduler::new(c).unwrap()
}

fn is_state(e: &CoreError) -> bool {
    matches!(e, CoreError::State(_))
}

/// `a` (20-token prompt) decoding, with `k` drafts installed for the next step.
fn decoding_with_drafts(k: usize) -> Scheduler {
    let mut s = scheduler(k, false);
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![7]);
    let drafts = vec![11; k];
    s.update_draft_token_ids([("a", drafts.as_slice())])
        .unwrap();
    s
}

#[test]
fn an_empty_sample_for_a_decode_with_drafts_is_refused_and_changes_nothing() {
    let mut s = decoding_with_drafts(4);
    let s1 = schedule(&mut s);
    assert_eq!(s1.num_scheduled_tokens, vec![5]);
    let before = format!("{:?}", req(&s, "a"));
    let mut upd = UpdateOutput::default();
    let err = s
        .update_from_output(s1.step_id, &[], &[0], &mut upd)
        .unwrap_err();
    assert!(matches!(err, CoreError::InvalidArgument(_)), "{err}");
    assert!(err.to_string().contains("sampled no token"), "{err}");
    assert_eq!(before, format!("{:?}", req(&s, "a")));
    s.check_invariants().unwrap();
    // The step is still in flight; its real output applies.
    apply(&mut s, &s1, |_| vec![11, 12]);
    assert_eq!(
        req(&s, "a").num_computed_tokens,
        req(&s, "a").num_tokens() - 1
    );
}

#[test]
fn an_empty_sample_for_a_decode_without_drafts_is_accepted_as_vllm_does() {
    let mut s = decoding_with_drafts(4);
    s.update_draft_token_ids([("a", &[][..])]).unwrap();
    let s1 = schedule(&mut s);
    assert_eq!(s1.num_scheduled_tokens, vec![1]);
    apply(&mut s, &s1, |_| Vec::new());
    assert_eq!(req(&s, "a").num_computed_tokens, req(&s, "a").num_tokens());
}

#[test]
fn an_idle_step_while_the_step_it_waits_for_is_in_flight_is_refused() {
    let mut s = scheduler(3, false);
    add(&mut s, "a", 20, 50);
    add(&mut s, "b", 20, 50);
    let s0 = schedule(&mut s);
    let before = (s.stats().clone(), s.prefix_cache_stats());
    let err = s.schedule(&mut StepOutput::default()).unwrap_err();
    assert!(is_state(&err), "{err}");
    assert!(err.to_string().contains("step 0 (2 requests)"), "{err}");
    assert_eq!(before, (s.stats().clone(), s.prefix_cache_stats()));
    // A step that has something to schedule is still planned (vLLM plans one while another
    // runs, as with pipelining): a new request is admitted.
    add(&mut s, "c", 20, 50);
    let s1 = schedule(&mut s);
    assert_eq!(s1.num_reqs(), 1);
    apply(&mut s, &s0, |_| vec![7]);
    apply(&mut s, &s1, |_| vec![7]);
}

#[test]
fn abandoning_a_first_step_puts_its_requests_back_in_the_queue() {
    let mut s = scheduler(3, false);
    add(&mut s, "a", 40, 5);
    add(&mut s, "b", 20, 5);
    let free = s.kv().num_free_blocks();
    let s0 = schedule(&mut s);
    assert_eq!(s.abandon_step(s0.step_id).unwrap(), 1);
    s.check_invariants().unwrap();
    assert_eq!(s.kv().num_free_blocks(), free);
    assert!(s.running().is_empty());
    let waiting: Vec<&str> = s
        .waiting_in_order()
        .iter()
        .map(|&slot| s.requests().get(slot).unwrap().spec.request_id.as_str())
        .collect();
    assert_eq!(waiting, ["a", "b"]);
    assert_eq!(req(&s, "a").status, RequestStatus::Waiting);
    assert_eq!(s.abandon_step(s0.step_id).unwrap(), 0, "already abandoned");
    let mut upd = UpdateOutput::default();
    let err = s
        .update_from_output(s0.step_id, &[7, 7], &[1, 1], &mut upd)
        .unwrap_err();
    assert!(err.to_string().contains("abandoned"), "{err}");
    let again = schedule(&mut s);
    assert_eq!(again.num_scheduled_tokens, s0.num_scheduled_tokens);
    apply(&mut s, &again, |_| vec![7]);
}

#[test]
fn abandoning_a_decode_keeps_the_blocks_and_drops_the_drafts() {
    let mut s = decoding_with_drafts(3);
    let computed = req(&s, "a").num_computed_tokens;
    let s1 = schedule(&mut s);
    let blocks = req(&s, "a").blocks.block_ids.clone();
    assert_eq!(s.abandon_step(s1.step_id).unwrap(), 1);
    s.check_invariants().unwrap();
    let a = req(&s, "a");
    assert_eq!(a.num_computed_tokens, computed);
    assert_eq!(a.num_in_flight_tokens, 0);
    assert!(a.spec_token_ids.is_empty());
    assert_eq!(a.blocks.block_ids, blocks);
    let retry = schedule(&mut s);
    assert_eq!(retry.num_scheduled_tokens, vec![1]);
    assert!(retry.new_block_ids.is_empty());
    apply(&mut s, &retry, |_| vec![8]);
}

#[test]
fn an_abandoned_prefill_leaves_no_prefix_hit_on_its_uncomputed_blocks() {
    let mut s = scheduler(3, false);
    let prompt: Vec<u32> = (100..164).collect();
    let spec = |id: &str| dflash_core::RequestSpec {
        request_id: id.to_owned(),
        prompt_token_ids: prompt.clone(),
        max_tokens: 4,
        ..Default::default()
    };
    s.add_request(spec("a")).unwrap();
    let s0 = schedule(&mut s);
    s.abandon_step(s0.step_id).unwrap();
    s.finish_requests(["a"], dflash_core::FinishReason::Abort)
        .unwrap();
    s.add_request(spec("b")).unwrap();
    let s1 = schedule(&mut s);
    assert_eq!(s1.num_computed_tokens, vec![0], "a's KV was never computed");
}

#[test]
fn with_async_scheduling_the_younger_step_is_abandoned_with_the_oldest() {
    let mut s = scheduler(3, true);
    add(&mut s, "a", 20, 50);
    let s0 = schedule(&mut s);
    apply(&mut s, &s0, |_| vec![7]);
    let (computed, tokens) = (req(&s, "a").num_computed_tokens, req(&s, "a").num_tokens());
    let s1 = schedule(&mut s);
    let s2 = schedule(&mut s);
    let err = s.abandon_step(s2.step_id).unwrap_err();
    assert!(
        is_state(&err) && err.to_string().contains("oldest"),
        "{err}"
    );
    assert_eq!(s.abandon_step(s1.step_id).unwrap(), 2);
    assert_eq!(s.abandon_step(s2.step_id).unwrap(), 0);
    s.check_invariants().unwrap();
    let a = req(&s, "a");
    assert_eq!(
        (
            a.num_computed_tokens,
            a.num_tokens(),
            a.num_output_placeholders
        ),
        (computed, tokens, 0)
    );
    let mut upd = UpdateOutput::default();
    for out in [&s1, &s2] {
        let err = s
            .update_from_output(out.step_id, &[7], &[1], &mut upd)
            .unwrap_err();
        assert!(is_state(&err), "{err}");
    }
    let retry = schedule(&mut s);
    assert_eq!(retry.num_scheduled_tokens, vec![1]);
    apply(&mut s, &retry, |_| vec![8]);
}

#[test]
fn a_request_finished_while_its_step_is_in_flight_stays_gone() {
    let mut s = scheduler(3, false);
    add(&mut s, "a", 20, 50);
    add(&mut s, "b", 20, 50);
    let s0 = schedule(&mut s);
    s.finish_requests(["a"], dflash_core::FinishReason::Abort)
        .unwrap();
    assert_eq!(s.abandon_step(s0.step_id).unwrap(), 1);
    s.check_invariants().unwrap();
    assert!(s.slot_of("a").is_none());
    assert_eq!(s.num_waiting(), 1);
}
