//! Steps awaiting their model output: what each scheduled entry needs when its output arrives
//! (or its step is abandoned), and the in-flight limit at which an idle step is refused.

use crate::error::{CoreError, CoreResult};
use crate::kv_manager::PrefixCacheStats;
use crate::output::StepOutput;

use super::Scheduler;

/// A scheduled entry awaiting its model output.
#[derive(Debug, Clone, Copy)]
pub(super) struct InFlightEntry {
    pub(super) slot: u32,
    pub(super) generation: u32,
    /// Position in scheduling order (running requests first, then admissions), which is the
    /// order vLLM processes outputs in; batch order is block-table row order.
    pub(super) rank: u32,
    pub(super) num_spec_tokens: u32,
    pub(super) is_prefill_chunk: bool,
    /// Tokens scheduled (taken off the request's in-flight count when the output arrives).
    pub(super) num_scheduled: u32,
    /// The request's preemption count at scheduling: an output scheduled before a later
    /// preemption is stale (its tokens are delivered, its counters were reset).
    pub(super) preemptions: u32,
    /// Stale output to drop rather than deliver (set by `preempt_all_running`; see `pause.rs`).
    pub(super) drop_output: bool,
    /// The request's `is_prefill_chunk` before this step (restored if the step is abandoned).
    pub(super) was_prefill_chunk: bool,
    /// Admitted by this step (a new or resumed entry): abandoning the step un-admits it.
    pub(super) admitted: bool,
    /// The request's prefix-cached blocks before this step's allocation: abandoning the step
    /// withdraws the ones it registered (their KV is never computed).
    pub(super) cached_before: u32,
}

/// A planned step awaiting its model output: its entries in batch order.
#[derive(Debug, Clone)]
pub(super) struct InFlightStep {
    pub(super) step_id: u64,
    pub(super) entries: Vec<InFlightEntry>,
}

impl Scheduler {
    /// Steps awaiting output from which an idle `schedule()` is refused: vLLM's engine keeps
    /// one step in flight in sync mode, and two (its batch queue) with async scheduling.
    pub fn max_steps_in_flight(&self) -> usize {
        if self.config.async_scheduling {
            2
        } else {
            1
        }
    }

    /// The prefix-cache counters before planning, if the step is planned at the in-flight limit
    /// (with `refuse_idle_steps`), where an idle step is refused.
    pub(super) fn lookups_if_at_limit(&self) -> Option<PrefixCacheStats> {
        let at_limit =
            self.config.refuse_idle_steps && self.in_flight.len() >= self.max_steps_in_flight();
        at_limit.then(|| self.kv.prefix_cache_stats())
    }

    /// Refuses the step just planned into `out` if it is idle (no request scheduled, no
    /// finished or preempted id to report) at the in-flight limit (`lookups_before` from
    /// [`Self::lookups_if_at_limit`]).
    pub(super) fn refuse_idle_step(
        &mut self,
        lookups_before: Option<PrefixCacheStats>,
        scheduled_order: &[u32],
        out: &StepOutput,
    ) -> CoreResult<()> {
        if let Some(lookups) = lookups_before {
            let idle = scheduled_order.is_empty()
                && out.preempted_req_ids.is_empty()
                && self.finished_ids.is_empty()
                && self.preempted_between_steps.is_empty();
            if idle {
                // Admission lookups that led nowhere are all this planning changed.
                self.kv.set_prefix_cache_stats(lookups);
                return Err(self.idle_step_error());
            }
        }
        Ok(())
    }

    /// The error of an idle step planned at the in-flight limit: what is pending.
    fn idle_step_error(&self) -> CoreError {
        let pending: Vec<String> = self
            .in_flight
            .iter()
            .map(|s| format!("step {} ({} requests)", s.step_id, s.entries.len()))
            .collect();
        CoreError::State(format!(
            "nothing to schedule until an output arrives: {} {} awaiting output ({} allows {} \
             in flight); apply the oldest with update_from_output, or abandon it with \
             abandon_step if it is lost",
            pending.join(", "),
            if pending.len() == 1 { "is" } else { "are" },
            if self.config.async_scheduling {
                "async scheduling"
            } else {
                "sync scheduling"
            },
            self.max_steps_in_flight(),
        ))
    }
}
