//! Finishing requests: out of the queues, blocks freed, the id reported once.

use crate::error::CoreResult;
use crate::output::EndedRequest;
use crate::requests::request::{FinishReason, RequestStatus};

use super::Scheduler;

impl Scheduler {
    /// Finishes a live request: out of the queues, blocks freed, id reported once.
    pub(super) fn finish(&mut self, slot: u32, reason: FinishReason) -> CoreResult<()> {
        let status = self.store.get(slot)?.status;
        match status {
            RequestStatus::Running => {
                if let Some(i) = self.running.iter().position(|&s| s == slot) {
                    self.running.remove(i);
                }
                self.rows.remove(&mut self.store, slot);
            }
            RequestStatus::Waiting | RequestStatus::Preempted => {
                self.waiting.remove(slot);
            }
            RequestStatus::Finished(_) => return Ok(()),
        }
        let mut r = self.store.remove(slot)?;
        if r.deferred {
            self.num_deferred -= 1;
        }
        self.kv.free(&mut r.blocks);
        r.status = RequestStatus::Finished(reason);
        self.finished_ids.push(r.spec.request_id);
        self.stats.num_finished += 1;
        Ok(())
    }

    /// Ends a request the pool can never hold (reason `Error`), reported by the next
    /// `update_from_output`. Only a pool smaller than one `max_model_len` request
    /// (`pool_must_hold_max_model_len` off, the vLLM drop-in) leads here: a pool that holds one
    /// holds any request alone, lookahead included, since allocations stop at `max_model_len`.
    pub(super) fn end_unservable(&mut self, slot: u32) -> CoreResult<()> {
        let request_id = self.store.get(slot)?.spec.request_id.clone();
        self.finish(slot, FinishReason::Error)?;
        self.ended_unreported.push(EndedRequest {
            request_id,
            finish_reason: FinishReason::Error,
        });
        Ok(())
    }

    /// Finishes the given requests (e.g. aborts); unknown ids are ignored. Returns the ids
    /// actually finished.
    pub fn finish_requests<'a>(
        &mut self,
        ids: impl IntoIterator<Item = &'a str>,
        reason: FinishReason,
    ) -> CoreResult<Vec<String>> {
        let mut done = Vec::new();
        for id in ids {
            if let Some(slot) = self.store.slot_of(id) {
                self.finish(slot, reason)?;
                done.push(id.to_owned());
            }
        }
        Ok(done)
    }
}
