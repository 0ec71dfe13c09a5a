//! Admission holds (vLLM's `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`): a waiting request whose
//! grammar is still compiling is passed over at admission, exactly where vLLM skips a request
//! in a blocked status, and keeps its place in the queue (vLLM re-queues the requests a step
//! skipped at the front, in their order). As in vLLM, a held request counts as a skipped
//! waiting request from the moment it is held until it is admitted or finished, even after
//! its release. The caller releases the hold once the grammar is ready;
//! [`Scheduler::held_passed_over`] names the held requests the last `schedule()` reached, the
//! ones vLLM would have checked (and, for a failed compilation, failed) in that step.

use crate::error::{invalid, CoreError, CoreResult};
use crate::requests::request::RequestStatus;

use super::Scheduler;

impl Scheduler {
    /// Holds a waiting request back from admission (`hold`), or releases it. Only a request
    /// that has never run may be held (vLLM's blocked status is set at arrival); releasing is
    /// always allowed and a no-op on a request not held. Unknown ids are refused.
    pub fn set_admission_hold(&mut self, request_id: &str, hold: bool) -> CoreResult<()> {
        let slot = self
            .store
            .slot_of(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(request_id.to_owned()))?;
        let r = self.store.get_mut(slot)?;
        if !hold {
            r.admission_hold = false;
            return Ok(());
        }
        if r.status != RequestStatus::Waiting {
            return Err(invalid!(
                "only a waiting request can be held back from admission; {request_id:?} is {:?}",
                r.status
            ));
        }
        r.admission_hold = true;
        if !r.deferred {
            r.deferred = true;
            self.num_deferred += 1;
        }
        Ok(())
    }

    /// Whether a live request is held back from admission.
    pub fn is_admission_held(&self, request_id: &str) -> CoreResult<bool> {
        let slot = self
            .store
            .slot_of(request_id)
            .ok_or_else(|| CoreError::UnknownRequest(request_id.to_owned()))?;
        Ok(self.store.get(slot)?.admission_hold)
    }

    /// Held requests the last `schedule()` passed over, in queue order (slots).
    pub fn held_passed_over(&self) -> &[u32] {
        &self.held_passed_over
    }
}
