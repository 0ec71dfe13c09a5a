//! The in-flight limit: how many steps may await their output before an idle `schedule()` is
//! refused (`refuse_idle_steps`), and the refusal.

use crate::error::{CoreError, CoreResult};
use crate::kv_manager::PrefixCacheStats;
use crate::output::StepOutput;

use super::Scheduler;

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
