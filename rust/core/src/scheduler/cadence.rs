//! The prefill cadence: steps that carry no prefill, so decodes run in longer stretches (vLLM
//! 0.33's `prefill_schedule_interval`, and its data-parallel prefill throttle).
//!
//! A step *holds prefills back* when either source asks for it:
//! - the engine's throttle ([`super::Scheduler::schedule_throttled`]; vLLM's DP engine core
//!   sets it on the steps between two cadence-aligned ones of its shared step counter);
//! - the local interval ([`crate::SchedulerConfig::local_prefill_interval`] > 1): until that
//!   many executed steps (steps that scheduled something) have passed since the last step that
//!   carried a prefill.
//!
//! and neither escape applies: some running request is decoding (else nothing would run), and
//! the last step that did not hold back drained the waiting queue of everything it could admit
//! (vLLM's capacity escape: a backed-up engine would otherwise cap prefill at one budget per
//! interval while its queue grows).
//!
//! A held-back step schedules no chunk of a running request's prefill and admits no waiting
//! request with more than one token left to compute (its prefix-cache hit is looked up first;
//! admissions stop at the first such request). Decodes, full prefix hits and requests passed
//! over (stale output, `max_loras`) go on as usual. With an interval of 1 and no throttle (the
//! defaults) nothing is ever held back and the step is today's.

/// The cadence's state across steps.
#[derive(Debug, Clone)]
pub(super) struct PrefillCadence {
    /// vLLM's `local_prefill_interval` (1: no local cadence).
    interval: i64,
    /// The last step that did not hold back left waiting requests it could have admitted
    /// (vLLM's `prefill_capacity_bound`): nothing is held back until one drains the queue.
    capacity_bound: bool,
    /// Executed step that last carried a prefill (vLLM's `last_prefill_step`); starts a full
    /// interval back, so the first step is never held.
    last_prefill_step: i64,
    /// Steps that scheduled something (vLLM's `num_executed_steps`).
    num_executed_steps: i64,
}

/// What one `schedule()` learns about prefills, applied with [`PrefillCadence::end_step`]
/// once the step is certain to be returned.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct StepPrefills {
    /// This step holds prefills back.
    pub hold: bool,
    /// A running request's prefill chunk was scheduled.
    pub scheduled: bool,
    /// A waiting request was admitted with more than one token left to compute.
    pub admitted: bool,
    /// The waiting phase ran without holding back: whether requests it could have admitted
    /// are still waiting (the new capacity bound).
    pub capacity_bound: Option<bool>,
}

impl PrefillCadence {
    pub(super) fn new(interval: usize) -> Self {
        let interval = i64::try_from(interval).unwrap_or(i64::MAX);
        Self {
            interval,
            capacity_bound: false,
            last_prefill_step: -interval,
            num_executed_steps: 0,
        }
    }

    /// Whether this step holds prefills back; `any_decoding` (some running request is past its
    /// prefill) is only asked when a source does.
    pub(super) fn holds_back(&self, throttle: bool, any_decoding: impl FnOnce() -> bool) -> bool {
        if self.capacity_bound {
            return false;
        }
        // This step becomes executed step `num_executed_steps + 1` if it schedules anything.
        let local = self.interval > 1
            && (self.num_executed_steps + 1) - self.last_prefill_step < self.interval;
        (throttle || local) && any_decoding()
    }

    /// Applies a returned step: `executed` when it scheduled something.
    pub(super) fn end_step(&mut self, step: StepPrefills, executed: bool) {
        if let Some(bound) = step.capacity_bound {
            self.capacity_bound = bound;
        }
        if executed {
            self.num_executed_steps += 1;
        }
        if self.interval > 1 && (step.scheduled || step.admitted) {
            self.last_prefill_step = self.num_executed_steps;
        }
    }

    /// vLLM's `prefill_capacity_bound` (for tests and invariants).
    pub(super) fn capacity_bound(&self) -> bool {
        self.capacity_bound
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(scheduled: bool, admitted: bool, bound: Option<bool>) -> StepPrefills {
        StepPrefills {
            hold: false,
            scheduled,
            admitted,
            capacity_bound: bound,
        }
    }

    #[test]
    fn interval_one_never_holds_back_without_throttle() {
        let mut c = PrefillCadence::new(1);
        for _ in 0..5 {
            assert!(!c.holds_back(false, || panic!("asked without a source")));
            c.end_step(step(true, true, Some(false)), true);
        }
    }

    #[test]
    fn first_step_is_never_held() {
        let c = PrefillCadence::new(4);
        assert!(!c.holds_back(false, || true));
    }

    #[test]
    fn holds_back_until_the_interval_has_passed_since_the_last_prefill() {
        let mut c = PrefillCadence::new(3);
        c.end_step(step(false, true, Some(false)), true); // executed step 1 prefills
        assert!(c.holds_back(false, || true)); // step 2: 2 - 1 < 3
        c.end_step(step(false, false, None), true);
        assert!(c.holds_back(false, || true)); // step 3: 3 - 1 < 3
        c.end_step(step(false, false, None), true);
        assert!(!c.holds_back(false, || true)); // step 4: released
    }

    #[test]
    fn idle_steps_do_not_advance_the_interval() {
        let mut c = PrefillCadence::new(2);
        c.end_step(step(true, false, Some(false)), true);
        for _ in 0..3 {
            assert!(c.holds_back(false, || true));
            c.end_step(step(false, false, None), false);
        }
        c.end_step(step(false, false, None), true);
        assert!(!c.holds_back(false, || true));
    }

    #[test]
    fn nothing_decoding_means_nothing_held() {
        let mut c = PrefillCadence::new(4);
        c.end_step(step(true, false, Some(false)), true);
        assert!(!c.holds_back(false, || false));
        assert!(!c.holds_back(true, || false));
    }

    #[test]
    fn throttle_holds_back_with_interval_one() {
        let c = PrefillCadence::new(1);
        assert!(c.holds_back(true, || true));
    }

    #[test]
    fn capacity_bound_releases_until_a_step_drains_the_queue() {
        let mut c = PrefillCadence::new(4);
        c.end_step(step(false, true, Some(true)), true);
        assert!(c.capacity_bound());
        assert!(!c.holds_back(true, || true));
        assert!(!c.holds_back(false, || true));
        c.end_step(step(false, true, Some(false)), true);
        assert!(c.holds_back(true, || true));
        assert!(c.holds_back(false, || true));
    }

    #[test]
    fn a_held_step_keeps_the_capacity_bound() {
        let mut c = PrefillCadence::new(1);
        c.end_step(step(false, false, Some(false)), true);
        c.end_step(step(false, false, None), true);
        assert!(!c.capacity_bound());
        assert!(c.holds_back(true, || true));
    }
}
