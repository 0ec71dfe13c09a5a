//! The prefill cadence (vLLM 0.33's `prefill_schedule_interval` and its DP prefill throttle):
//! `Scheduler::schedule_throttled` and `SchedulerConfig::local_prefill_interval`. A held-back
//! step schedules running decodes but no prefill chunk and no admission with more than one
//! token left; nothing is held while no running request decodes, nor after a release that left
//! the queue backed up. Property tests: a model of vLLM's rule predicts every held step, and
//! with the escapes in force (or the defaults) a throttled scheduler is today's step for step.

mod common;

use common::{add, apply, ids, req, rng};
use dflash_core::{EntryKind, PauseState, Scheduler, SchedulerConfig, StepOutput};
use proptest::prelude::*;
use proptest::test_runner::TestRng;

const BS: usize = 16;

fn config(interval: usize, budget: usize) -> SchedulerConfig {
    let mut c = SchedulerConfig::new(200, BS, 512, 8, budget);
    c.local_prefill_interval = interval;
    c
}

/// A scheduler of `config(interval, budget)` with `requests` (id, prompt length, max tokens)
/// added in order.
fn scheduler(interval: usize, budget: usize, requests: &[(&str, usize, usize)]) -> Scheduler {
    let mut s = Scheduler::new(config(interval, budget)).unwrap();
    for &(id, prompt_len, max_tokens) in requests {
        add(&mut s, id, prompt_len, max_tokens);
    }
    s
}

/// One `schedule_throttled(throttle)`, with the invariants checked after it.
fn step(s: &mut Scheduler, throttle: bool) -> StepOutput {
    let mut out = StepOutput::default();
    s.schedule_throttled(&mut out, throttle).unwrap();
    s.check_invariants().unwrap();
    out
}

/// A step entry: (id, kind, tokens).
type Entry = (String, EntryKind, i32);

/// The entry of running request `id` scheduled for `tokens`.
fn running(id: &str, tokens: i32) -> Entry {
    (id.into(), EntryKind::Running, tokens)
}

/// The entry of new request `id` admitted for `tokens`.
fn admitted(id: &str, tokens: i32) -> Entry {
    (id.into(), EntryKind::New, tokens)
}

/// The entries of `out`.
fn entries(s: &Scheduler, out: &StepOutput) -> Vec<Entry> {
    ids(s, &out.slots)
        .into_iter()
        .zip(&out.kinds)
        .zip(&out.num_scheduled_tokens)
        .map(|((id, &k), &n)| (id, k, n))
        .collect()
}

/// Runs `out` with every sampling entry getting one ordinary token.
fn run(s: &mut Scheduler, out: &StepOutput) {
    apply(s, out, |_| vec![100]);
}

/// One step, then its output ([`run`]).
fn step_and_run(s: &mut Scheduler, throttle: bool) {
    let out = step(s, throttle);
    run(s, &out);
}

/// A scheduler whose request "d" is decoding after two steps (prefill, first decode).
fn decoding(interval: usize) -> Scheduler {
    let mut s = scheduler(interval, 256, &[("d", 20, 100)]);
    step_and_run(&mut s, false);
    s
}

#[test]
fn local_interval_holds_admissions_while_decodes_run() {
    let mut s = decoding(3); // executed step 1 carried d's prefill
    add(&mut s, "w", 40, 4);
    for _ in 0..2 {
        // Steps 2 and 3: 2 - 1 and 3 - 1 < 3.
        let out = step(&mut s, false);
        assert_eq!(entries(&s, &out), [running("d", 1)]);
        run(&mut s, &out);
    }
    let out = step(&mut s, false); // step 4: released
    assert_eq!(entries(&s, &out), [running("d", 1), admitted("w", 40)]);
}

#[test]
fn throttle_holds_running_prefill_chunks_back() {
    let mut s = scheduler(1, 48, &[("d", 20, 100), ("p", 100, 4)]);
    step_and_run(&mut s, false); // d whole, p's first 28 tokens
    assert!(req(&s, "p").is_prefill_chunk);
    let out = step(&mut s, true);
    assert_eq!(entries(&s, &out), [running("d", 1)]);
    run(&mut s, &out);
    let out = step(&mut s, false);
    assert_eq!(entries(&s, &out), [running("d", 1), running("p", 47)]);
}

#[test]
fn nothing_decoding_means_nothing_held_back() {
    let mut s = scheduler(4, 256, &[("a", 20, 4)]);
    let out = step(&mut s, true);
    assert_eq!(entries(&s, &out), [admitted("a", 20)]);
    // Only a prefill chunk running: the next admission is not held either.
    let mut s = scheduler(1, 32, &[("a", 100, 4), ("b", 20, 4)]);
    step_and_run(&mut s, true);
    let out = step(&mut s, true);
    assert_eq!(entries(&s, &out), [running("a", 32)]);
}

#[test]
fn a_full_prefix_hit_is_admitted_on_a_held_step() {
    let mut s = decoding(1);
    // "d"'s prompt again: every block but the last token is a hit (one token left).
    let prompt: Vec<u32> = (1000..1016).collect(); // d's first block (common::add)
    let spec = |id: &str, prompt: Vec<u32>| dflash_core::RequestSpec {
        request_id: id.to_owned(),
        prompt_token_ids: prompt,
        max_tokens: 4,
        arrival_time: 10.0,
        ..Default::default()
    };
    let mut hit = prompt.clone();
    hit.push(7);
    s.add_request(spec("hit", hit)).unwrap();
    let mut miss = prompt;
    miss.extend([7, 8]);
    s.add_request(spec("miss", miss)).unwrap();
    let out = step(&mut s, true);
    assert_eq!(entries(&s, &out), [running("d", 1), admitted("hit", 1)]);
    // The request needing a prefill stops admission there; it keeps its place.
    assert_eq!(ids(&s, &s.waiting_in_order()), ["miss"]);
}

#[test]
fn a_release_that_leaves_the_queue_backed_up_stops_the_cadence() {
    let mut s = scheduler(4, 60, &[("d", 20, 100), ("a", 40, 4), ("b", 40, 4)]);
    let out = step(&mut s, false); // d, a fill the budget; b left waiting
    assert_eq!(out.num_reqs(), 2);
    assert!(s.prefill_capacity_bound());
    run(&mut s, &out);
    // Interval not over, throttled too: admitted anyway while the queue is backed up.
    let out = step(&mut s, true);
    assert!(entries(&s, &out).contains(&admitted("b", 40)));
    run(&mut s, &out);
    assert!(!s.prefill_capacity_bound()); // that release drained the queue
    add(&mut s, "c", 20, 4);
    let out = step(&mut s, true);
    assert!(out.kinds.iter().all(|&k| k == EntryKind::Running));
}

#[test]
fn paused_new_records_the_capacity_bound() {
    let mut s = decoding(1);
    add(&mut s, "w", 20, 4);
    s.set_pause_state(PauseState::PausedNew);
    step_and_run(&mut s, false);
    assert!(
        s.prefill_capacity_bound(),
        "vLLM: the release admitted nobody"
    );
    s.set_pause_state(PauseState::Unpaused);
    let out = step(&mut s, true); // not held: the bound lets w in
    assert!(entries(&s, &out).contains(&admitted("w", 20)));
}

#[test]
fn idle_steps_do_not_count_towards_the_interval() {
    let mut s = decoding(2); // executed step 1 carried d's prefill
    s.set_pause_state(PauseState::PausedAll);
    for _ in 0..3 {
        assert_eq!(step(&mut s, false).num_reqs(), 0);
    }
    s.set_pause_state(PauseState::Unpaused);
    add(&mut s, "w", 20, 10);
    // Executed step 2, one after the prefill: still held.
    let out = step(&mut s, false);
    assert_eq!(entries(&s, &out), [running("d", 1)]);
    run(&mut s, &out);
    let out = step(&mut s, false);
    assert!(entries(&s, &out).contains(&admitted("w", 20)));
}

#[test]
fn a_refused_idle_step_leaves_the_cadence_unchanged() {
    // "a"'s output is in flight (sync: nothing to schedule until it arrives) and "b" cannot be
    // admitted under PAUSED_NEW: the step is idle at the in-flight limit.
    let paused_with_a_in_flight = |refuse_idle_steps: bool| {
        let mut c = config(1, 256);
        c.refuse_idle_steps = refuse_idle_steps;
        let mut s = Scheduler::new(c).unwrap();
        add(&mut s, "a", 20, 10);
        let first = step(&mut s, false);
        add(&mut s, "b", 20, 10);
        s.set_pause_state(PauseState::PausedNew);
        (s, first)
    };
    let (mut s, first) = paused_with_a_in_flight(true);
    assert!(!s.prefill_capacity_bound());
    assert!(s
        .schedule_throttled(&mut StepOutput::default(), false)
        .is_err());
    assert!(
        !s.prefill_capacity_bound(),
        "a refused step changes nothing"
    );
    run(&mut s, &first);
    // The same step returned (not refused) records the bound: the waiting "b" was not admitted.
    let (mut s, _) = paused_with_a_in_flight(false);
    s.schedule_throttled(&mut StepOutput::default(), false)
        .unwrap();
    assert!(s.prefill_capacity_bound());
}

#[test]
fn interval_is_validated() {
    for bad in [0, i32::MAX as usize + 1] {
        let err = Scheduler::new(config(bad, 256)).unwrap_err();
        assert!(err.to_string().contains("local_prefill_interval"), "{err}");
    }
    assert!(Scheduler::new(config(i32::MAX as usize, 256)).is_ok());
}

// ------------------------------------------------------------------ properties

#[derive(Debug, Clone)]
struct Workload {
    seed: u64,
    interval: usize,
    /// Chance per step (in 1/8) of `throttle_prefills`.
    throttle_eighths: u32,
    budget: usize,
    num_blocks: usize,
    num_requests: usize,
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        any::<u64>(),
        1usize..=4,
        0u32..=8,
        prop_oneof![Just(32usize), Just(64), Just(128)],
        prop_oneof![Just(24usize), Just(48), Just(200)],
        4usize..16,
    )
        .prop_map(
            |(seed, interval, throttle_eighths, budget, num_blocks, num_requests)| Workload {
                seed,
                interval,
                throttle_eighths,
                budget,
                num_blocks,
                num_requests,
            },
        )
}

/// A scheduler for workload `w` with local prefill interval `interval`.
fn property_scheduler(w: &Workload, interval: usize) -> Scheduler {
    let max_model_len = 256.min((w.num_blocks - 1) * BS);
    let mut c = SchedulerConfig::new(w.num_blocks, BS, max_model_len, 6, w.budget);
    c.local_prefill_interval = interval;
    Scheduler::new(c).unwrap()
}

/// vLLM 0.33's cadence rule, kept from what the steps show.
#[derive(Debug, Default)]
struct CadenceModel {
    capacity_bound: bool,
    last_prefill_step: i64,
    executed: i64,
}

/// Adds this step's arrivals, drawn from `rng` (prompt lengths, output lengths), the same for
/// every scheduler of one workload; `next` counts the requests arrived so far.
fn arrive(s: &mut Scheduler, rng: &mut TestRng, w: &Workload, next: &mut usize) {
    let max_model_len = s.config().max_model_len;
    while *next < w.num_requests && (*next == 0 || rng.next_u32() % 3 == 0) {
        let prompt = 8 + rng.next_u32() as usize % (max_model_len / 2);
        let max_tokens = 1 + rng.next_u32() as usize % 24;
        add(s, &format!("r{next}"), prompt, max_tokens);
        *next += 1;
    }
}

/// Applies a random output for `out` (EOS one token in 16) to `s`.
fn apply_random_output(s: &mut Scheduler, out: &StepOutput, rng: &mut TestRng) {
    let (tokens, counts) = common::random_output(out, rng, |r| {
        if r.next_u32() % 16 == 0 {
            2
        } else {
            100 + r.next_u32() % 1000
        }
    });
    let mut upd = dflash_core::UpdateOutput::default();
    s.update_from_output(out.step_id, &tokens, &counts, &mut upd)
        .unwrap();
}

/// Whether each entry of `out` carries a prefill: a running request's chunk (it was a prefill
/// chunk before the step) or an admission with more than one token left.
fn prefill_entries(s: &Scheduler, out: &StepOutput, chunk_before: &[(u32, bool)]) -> Vec<bool> {
    (0..out.num_reqs())
        .map(|i| {
            let slot = out.slots[i];
            match out.kinds[i] {
                EntryKind::Running => chunk_before.iter().any(|&(s2, chunk)| s2 == slot && chunk),
                _ => {
                    let r = s.requests().get(slot).unwrap();
                    (out.num_computed_tokens[i] as usize) + 1 < r.num_tokens()
                }
            }
        })
        .collect()
}

/// Drives one workload through a scheduler with the workload's interval and throttle draws,
/// checking each step against [`CadenceModel`]; returns the steps it took to finish everything.
fn run_against_model(w: &Workload) -> Result<usize, TestCaseError> {
    let mut s = property_scheduler(w, w.interval);
    let mut rng = rng(w.seed);
    let mut model = CadenceModel {
        last_prefill_step: -(w.interval as i64),
        ..Default::default()
    };
    let mut next = 0;
    for n in 0..3000 {
        arrive(&mut s, &mut rng, w, &mut next);
        if s.num_unfinished() == 0 && next >= w.num_requests {
            return Ok(n);
        }
        // Throttle draws stop after 400 steps: everything must then finish.
        let throttle = n < 400 && rng.next_u32() % 8 < w.throttle_eighths;
        let chunk_before: Vec<(u32, bool)> = s
            .running()
            .iter()
            .map(|&slot| (slot, s.requests().get(slot).unwrap().is_prefill_chunk))
            .collect();
        let any_decoding = chunk_before.iter().any(|&(_, chunk)| !chunk);
        let interval = w.interval as i64;
        let local = interval > 1 && model.executed + 1 - model.last_prefill_step < interval;
        let hold = !model.capacity_bound && (throttle || local) && any_decoding;
        let out = step(&mut s, throttle);
        let prefills = prefill_entries(&s, &out, &chunk_before);
        if hold {
            prop_assert!(
                !prefills.iter().any(|&p| p),
                "step {n}: held back, yet {:?} carry prefills",
                entries(&s, &out)
            );
        }
        if out.preempted_req_ids.is_empty() && !hold {
            model.capacity_bound = s.num_waiting() > s.num_deferred_waiting();
        }
        prop_assert_eq!(
            s.prefill_capacity_bound(),
            model.capacity_bound,
            "step {}",
            n
        );
        if out.num_reqs() > 0 {
            model.executed += 1;
        }
        if interval > 1 && prefills.iter().any(|&p| p) {
            model.last_prefill_step = model.executed;
        }
        apply_random_output(&mut s, &out, &mut rng);
        s.check_invariants().unwrap();
    }
    Err(TestCaseError::fail("requests did not finish in 3000 steps"))
}

/// One workload through `sched`, throttled where `throttle(step, scheduler)` says; returns
/// every step's entries and preempted/finished ids.
fn trace(
    w: &Workload,
    mut s: Scheduler,
    explicit: bool,
    throttle: impl Fn(&Scheduler) -> bool,
) -> Vec<String> {
    let mut rng = rng(w.seed);
    let mut next = 0;
    let mut log = Vec::new();
    for _ in 0..600 {
        arrive(&mut s, &mut rng, w, &mut next);
        if s.num_unfinished() == 0 && next >= w.num_requests {
            break;
        }
        let mut out = StepOutput::default();
        if explicit {
            let t = throttle(&s);
            s.schedule_throttled(&mut out, t).unwrap();
        } else {
            s.schedule(&mut out).unwrap();
        }
        log.push(format!(
            "{:?} {:?} {:?} {:?} {:?}",
            entries(&s, &out),
            out.num_computed_tokens,
            out.new_block_ids,
            out.preempted_req_ids,
            out.finished_req_ids
        ));
        apply_random_output(&mut s, &out, &mut rng);
    }
    log
}

/// Whether no running request is past its prefill (a throttle then holds nothing back).
fn nothing_decoding(s: &Scheduler) -> bool {
    s.running()
        .iter()
        .all(|&slot| s.requests().get(slot).unwrap().is_prefill_chunk)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Every step the model holds back carries no prefill, the capacity bound follows vLLM's
    /// rule, and everything finishes once the throttle stops.
    #[test]
    fn held_steps_carry_no_prefill(w in workload()) {
        run_against_model(&w)?;
    }

    /// With interval 1 and no throttle, `schedule_throttled(false)` is `schedule()` (today's
    /// step); a throttle where an escape applies (nothing decoding, the queue backed up)
    /// changes nothing either.
    #[test]
    fn defaults_and_escapes_are_todays_schedule(w in workload()) {
        let today = trace(&w, property_scheduler(&w, 1), false, |_| false);
        let explicit = trace(&w, property_scheduler(&w, 1), true, |_| false);
        prop_assert_eq!(&today, &explicit);
        let escaped = trace(&w, property_scheduler(&w, 1), true, |s| {
            nothing_decoding(s) || s.prefill_capacity_bound()
        });
        prop_assert_eq!(&today, &escaped);
    }

    /// A throttle on every step with the local interval on too holds no more than the throttle
    /// alone: the two sources combine as one hold.
    #[test]
    fn always_throttled_ignores_the_interval(w in workload()) {
        let throttled = trace(&w, property_scheduler(&w, 1), true, |_| true);
        let both = trace(&w, property_scheduler(&w, w.interval), true, |_| true);
        prop_assert_eq!(&throttled, &both);
    }
}
