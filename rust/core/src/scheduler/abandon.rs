//! Abandoning steps whose output will never come (the runner raised, the batch was lost).
//!
//! An abandoned step undoes its computation, not the decisions made around it:
//!
//! - Requests it scheduled that were running go back to their state before it: the tokens it
//!   scheduled are not computed (`num_computed_tokens` back), its async output placeholders are
//!   removed, and its drafts are dropped (the next step verifies none unless new ones are
//!   installed). They keep every block they hold, those it allocated included: the allocation
//!   stands, and the next step reuses the blocks (so `new_block_ids` does not list them again;
//!   `block_table` shows whole rows).
//! - Requests it admitted go back to the front of the waiting queue, as new or preempted, their
//!   blocks freed; they are admitted again by a later step.
//! - Blocks it registered in the prefix cache for KV it would have computed are withdrawn, so no
//!   later prefix hit reads KV that was never written.
//! - Requests finished or aborted meanwhile stay gone; preemptions it made stand; its finished
//!   and preempted ids are not reported again (the abandoned output still lists them).
//!
//! Only the oldest step awaiting output can be abandoned. With async scheduling the younger step
//! in flight was planned on top of it (its tokens follow the older step's placeholders), so it is
//! abandoned with it. The output of an abandoned step is refused (`State`).

use crate::error::{broken, CoreError, CoreResult};
use crate::requests::request::RequestStatus;

use super::admission::priority_key;
use super::in_flight::InFlightEntry;
use super::Scheduler;

/// Abandoned step ids remembered, to say so when their output arrives (an older one is refused
/// as already applied: still a `State` error).
const MAX_ABANDONED_REMEMBERED: usize = 64;

impl Scheduler {
    /// Abandons step `step_id`, which must be the oldest step awaiting output, together with
    /// every younger step in flight (see the module docs). Returns how many steps were
    /// abandoned: 0 when `step_id` was abandoned already (as a younger step, say).
    pub fn abandon_step(&mut self, step_id: u64) -> CoreResult<usize> {
        if self.abandoned_steps.contains(&step_id) {
            return Ok(0);
        }
        let Some(oldest) = self.in_flight.front() else {
            return Err(self.no_output_awaited(step_id));
        };
        if oldest.step_id != step_id {
            return Err(if self.in_flight.iter().any(|s| s.step_id == step_id) {
                CoreError::State(format!(
                    "step {step_id} is not the oldest step awaiting output: apply or abandon \
                     step {} first (abandoning it abandons step {step_id} too)",
                    oldest.step_id
                ))
            } else {
                self.no_output_awaited(step_id)
            });
        }
        let num_steps = self.in_flight.len();
        while let Some(step) = self.in_flight.pop_back() {
            // Scheduling order reversed: a request admitted after another in the same step may
            // hold prefix hits on the blocks the other registered; it lets go of them first.
            let mut entries = step.entries;
            entries.sort_unstable_by_key(|e| std::cmp::Reverse(e.rank));
            for e in &entries {
                self.roll_back_entry(e)?;
            }
            if self.abandoned_steps.len() == MAX_ABANDONED_REMEMBERED {
                self.abandoned_steps.remove(0);
            }
            self.abandoned_steps.push(step.step_id);
        }
        Ok(num_steps)
    }

    /// Whether `step_id` was abandoned.
    pub fn is_abandoned(&self, step_id: u64) -> bool {
        self.abandoned_steps.contains(&step_id)
    }

    fn no_output_awaited(&self, step_id: u64) -> CoreError {
        CoreError::State(if step_id >= self.next_step_id {
            format!("step {step_id} was not scheduled yet")
        } else {
            format!("step {step_id} awaits no output (it was applied, or scheduled nothing)")
        })
    }

    /// Undoes what scheduling `e` did to its request, if the request is still the same one and
    /// was not preempted since (preemption already reset its progress).
    fn roll_back_entry(&mut self, e: &InFlightEntry) -> CoreResult<()> {
        if e.drop_output {
            self.num_dropped_in_flight -= 1;
        }
        let async_scheduling = self.config.async_scheduling;
        let block_size = self.config.block_size;
        let Some(r) = self.store.get_mut_if_current(e.slot, e.generation) else {
            return Ok(());
        };
        r.num_in_flight_tokens = r
            .num_in_flight_tokens
            .checked_sub(e.num_scheduled as usize)
            .ok_or_else(|| broken!("abandoned step: in-flight tokens below the step's"))?;
        if r.num_preemptions != e.preemptions {
            return Ok(());
        }
        if e.admitted {
            return self.unadmit(e);
        }
        r.num_computed_tokens = r
            .num_computed_tokens
            .checked_sub(e.num_scheduled as usize)
            .ok_or_else(|| broken!("abandoned step: computed tokens below the step's"))?;
        if async_scheduling && !e.is_prefill_chunk {
            let placeholders = 1 + e.num_spec_tokens as usize;
            r.num_output_placeholders = r
                .num_output_placeholders
                .checked_sub(placeholders)
                .ok_or_else(|| broken!("abandoned step: placeholders below the step's"))?;
        }
        r.spec_token_ids.clear();
        r.is_prefill_chunk = e.was_prefill_chunk;
        // Blocks full of KV computed before the step keep their entries.
        let keep = (e.cached_before as usize).max(r.num_computed_tokens / block_size);
        self.kv.uncache_blocks(&mut r.blocks, keep);
        Ok(())
    }

    /// Takes back the admission of `e`'s request: out of `running` and its row, blocks freed
    /// (the ones the step registered withdrawn first), back to the front of the waiting queue.
    fn unadmit(&mut self, e: &InFlightEntry) -> CoreResult<()> {
        let slot = e.slot;
        let index = self
            .running
            .iter()
            .rposition(|&s| s == slot)
            .ok_or_else(|| broken!("abandoned step: an admitted request is not running"))?;
        self.running.remove(index);
        self.rows.remove(&mut self.store, slot);
        let r = self.store.get_mut(slot)?;
        self.kv
            .uncache_blocks(&mut r.blocks, e.cached_before as usize);
        self.kv.free(&mut r.blocks);
        r.status = if r.num_preemptions > 0 {
            RequestStatus::Preempted
        } else {
            RequestStatus::Waiting
        };
        r.num_computed_tokens = 0;
        r.num_output_placeholders = 0;
        r.spec_token_ids.clear();
        r.is_prefill_chunk = false;
        let key = priority_key(r);
        self.waiting.push_front(slot, key);
        Ok(())
    }
}
