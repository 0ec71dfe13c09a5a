//! Pausing and resetting (vLLM 0.33's `set_pause_state` and
//! `reset_prefix_cache(reset_running_requests=True)`).
//!
//! - [`PauseState`]: `PausedNew` keeps scheduling running requests but admits nobody from the
//!   waiting queue (preempted requests included); `PausedAll` schedules nothing, yet each
//!   `schedule()` still reports the ids finished or preempted since the previous step.
//! - [`Scheduler::preempt_all_running`] preempts every running request, last first, so that
//!   they return to the front of the waiting queue in running order. With
//!   `drop_stale_outputs`, the output of their steps still in flight is *dropped* when it
//!   arrives (no token, no counter, no stat), and they may resume in the very next step: their
//!   positions are recomputed and resampled. Otherwise it is the ordinary preemption: stale
//!   output is delivered and the request waits for it before it resumes.
//!
//! Dropping is marked per in-flight entry (`InFlightEntry::drop_output`), which gives vLLM's
//! per-request rule exactly: vLLM drops a stale output when the request's `drop_stale_output`
//! is set, and a later ordinary preemption keeps that flag only while some of the dropped share
//! is still in flight (then the whole new stale share is dropped too). Marked entries are
//! always stale and are a prefix of the request's entries in flight.

use crate::error::{broken, invalid, CoreResult};
use crate::output::StepOutput;

use super::Scheduler;

/// What `schedule()` may schedule (vLLM 0.33's `PauseState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PauseState {
    /// Schedule running requests and admit waiting ones.
    #[default]
    Unpaused,
    /// Schedule running requests; admit no waiting (or preempted) request.
    PausedNew,
    /// Schedule nothing (steps still report finished and preempted ids).
    PausedAll,
}

impl PauseState {
    /// `"unpaused"`, `"paused_new"` or `"paused_all"`.
    pub fn name(self) -> &'static str {
        match self {
            PauseState::Unpaused => "unpaused",
            PauseState::PausedNew => "paused_new",
            PauseState::PausedAll => "paused_all",
        }
    }

    /// Parses [`Self::name`].
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "unpaused" => Ok(PauseState::Unpaused),
            "paused_new" => Ok(PauseState::PausedNew),
            "paused_all" => Ok(PauseState::PausedAll),
            other => Err(invalid!(
                "pause state must be \"unpaused\", \"paused_new\" or \"paused_all\", got {other:?}"
            )),
        }
    }
}

impl Scheduler {
    /// The pause state `schedule()` follows.
    pub fn pause_state(&self) -> PauseState {
        self.pause
    }

    /// Sets the pause state; takes effect at the next `schedule()`.
    pub fn set_pause_state(&mut self, pause: PauseState) {
        self.pause = pause;
    }

    /// Preempts every running request, in reverse running order (vLLM 0.33's
    /// `reset_prefix_cache(reset_running_requests=True)` loop), so that they head the waiting
    /// queue in their running order. Returns their ids in preemption order; they are also
    /// reported in the next step's `preempted_req_ids`. With `drop_stale_outputs`, the output of
    /// their steps in flight will be dropped (see the module docs).
    pub fn preempt_all_running(&mut self, drop_stale_outputs: bool) -> CoreResult<Vec<String>> {
        crate::fault::hit("preempt_all.begin")?;
        let mut scratch = StepOutput::default();
        while let Some(slot) = self.running.pop() {
            self.preempt(slot, &mut scratch)?;
            if drop_stale_outputs {
                self.drop_output_in_flight(slot);
            }
        }
        self.preempted_between_steps
            .extend(scratch.preempted_req_ids.iter().cloned());
        Ok(scratch.preempted_req_ids)
    }

    /// vLLM 0.33's `reset_prefix_cache(reset_running_requests=True)`: preempts every running
    /// request, dropping the output of their steps in flight, then empties the prefix cache.
    /// Returns the preempted ids. Nothing holds a block afterwards, so the reset cannot fail.
    pub fn reset_prefix_cache_preempting_running(&mut self) -> CoreResult<Vec<String>> {
        let ids = self.preempt_all_running(true)?;
        if !self.kv.reset_prefix_cache() {
            return Err(broken!(
                "the prefix cache could not be reset with every running request preempted"
            ));
        }
        Ok(ids)
    }

    /// Marks the request's entries in flight (all stale now) to be dropped.
    fn drop_output_in_flight(&mut self, slot: u32) {
        let generation = self.store.generation(slot);
        for step in &mut self.in_flight {
            for e in &mut step.entries {
                if e.slot == slot && e.generation == generation && !e.drop_output {
                    e.drop_output = true;
                    self.num_dropped_in_flight += 1;
                }
            }
        }
    }

    /// Whether the request has output in flight that will be dropped.
    pub(super) fn drops_stale_output(&self, slot: u32) -> bool {
        if self.num_dropped_in_flight == 0 {
            return false;
        }
        let generation = self.store.generation(slot);
        self.in_flight.iter().any(|step| {
            step.entries
                .iter()
                .any(|e| e.slot == slot && e.generation == generation && e.drop_output)
        })
    }

    /// Called by every preemption: while some of the request's dropped output is still in
    /// flight, the output that becomes stale now is dropped as well (vLLM keeps the request's
    /// `drop_stale_output` flag then, and it covers the whole stale share).
    pub(super) fn keep_dropping_stale_output(&mut self, slot: u32) {
        if self.drops_stale_output(slot) {
            self.drop_output_in_flight(slot);
        }
    }
}
