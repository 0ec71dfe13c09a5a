//! The scheduler's invariant check, including the ownership contract.

use crate::error::{broken, CoreResult};
use crate::requests::request::RequestStatus;

use super::Scheduler;

impl Scheduler {
    /// Checks every invariant: pool accounting and ref counts, queue membership, block-table
    /// rows, the ownership contract (every running request owns slots for
    /// `min(num_computed + required lookahead, max_model_len)` positions, placeholders
    /// included), the in-flight bookkeeping of async scheduling, and that no request counts more
    /// computed tokens than its tokens plus what its steps in flight deliver.
    pub fn check_invariants(&self) -> CoreResult<()> {
        self.kv
            .check_invariants(self.store.iter().map(|(_, r)| &r.blocks))?;
        if self.running.len() > self.config.max_num_seqs {
            return Err(broken!(
                "{} running requests exceed max_num_seqs {}",
                self.running.len(),
                self.config.max_num_seqs
            ));
        }
        if self.running.len() + self.waiting.len() != self.store.len() {
            return Err(broken!(
                "running {} + waiting {} != live requests {}",
                self.running.len(),
                self.waiting.len(),
                self.store.len()
            ));
        }
        let table = self.rows.table();
        let required = self.config.required_lookahead();
        let bs = self.config.block_size;
        for &slot in &self.running {
            let r = self.store.get(slot)?;
            if r.status != RequestStatus::Running {
                return Err(broken!(
                    "request {:?} is in running with status {:?}",
                    r.spec.request_id,
                    r.status
                ));
            }
            let row = self
                .store
                .row(slot)
                .ok_or_else(|| broken!("running request without a row"))?
                as usize;
            let ids: Vec<i32> = r.blocks.block_ids.iter().map(|&b| b as i32).collect();
            if table.row(row) != ids.as_slice() {
                return Err(broken!(
                    "block-table row {row} differs from request {:?}'s blocks",
                    r.spec.request_id
                ));
            }
            if table.full_row(row)[ids.len()..].iter().any(|&x| x != 0) {
                return Err(broken!(
                    "block-table row {row} holds stale ids past its count"
                ));
            }
            if r.admission_hold {
                return Err(broken!(
                    "running request {:?} is held back from admission",
                    r.spec.request_id
                ));
            }
            let must_own = (r.num_computed_tokens + required).min(self.config.max_model_len);
            if r.blocks.block_ids.len() * bs < must_own {
                return Err(broken!(
                    "ownership: request {:?} owns {} slots but positions up to {} must be writable",
                    r.spec.request_id,
                    r.blocks.block_ids.len() * bs,
                    must_own
                ));
            }
        }
        let mut num_deferred = 0;
        for slot in self.waiting.handles_in_order() {
            let r = self.store.get(slot)?;
            num_deferred += usize::from(r.deferred);
            if !matches!(r.status, RequestStatus::Waiting | RequestStatus::Preempted) {
                return Err(broken!(
                    "request {:?} is waiting with status {:?}",
                    r.spec.request_id,
                    r.status
                ));
            }
            if r.admission_hold && (r.status != RequestStatus::Waiting || !r.deferred) {
                return Err(broken!(
                    "held request {:?} is {:?} or not counted as skipped",
                    r.spec.request_id,
                    r.status
                ));
            }
            if !r.blocks.block_ids.is_empty() || self.store.row(slot).is_some() {
                return Err(broken!(
                    "waiting request {:?} holds blocks or a row",
                    r.spec.request_id
                ));
            }
        }
        if num_deferred != self.num_deferred {
            return Err(broken!(
                "{num_deferred} waiting requests are deferred but {} are counted",
                self.num_deferred
            ));
        }
        self.check_in_flight()?;
        for row in self.rows.len()..table.num_rows() {
            if table.counts()[row] != 0 || table.full_row(row).iter().any(|&x| x != 0) {
                return Err(broken!("unused block-table row {row} is not zero"));
            }
        }
        Ok(())
    }

    /// Each live request's in-flight token count is what its steps awaiting output scheduled;
    /// its placeholders are 0 unless it runs in async mode, and never exceed that count; its
    /// computed tokens never exceed its tokens plus what is in flight.
    /// Output marked to be dropped is counted, stale, and a prefix of the request's output in
    /// flight (all of it for a preempted request, or none).
    fn check_in_flight(&self) -> CoreResult<()> {
        let mut in_flight = vec![0usize; self.store.capacity()];
        let mut drafts_in_flight = vec![0usize; self.store.capacity()];
        let mut dropped = vec![false; self.store.capacity()];
        let mut delivered = vec![false; self.store.capacity()];
        let mut num_dropped = 0;
        for step in &self.in_flight {
            for e in &step.entries {
                num_dropped += usize::from(e.drop_output);
                if self.store.slot_of_generation(e.slot) != Some(e.generation) {
                    continue;
                }
                let s = e.slot as usize;
                in_flight[s] += e.num_scheduled as usize;
                drafts_in_flight[s] += e.num_spec_tokens as usize;
                if !e.drop_output {
                    delivered[s] = true;
                    continue;
                }
                dropped[s] = true;
                let r = self.store.get(e.slot)?;
                if delivered[s] || r.num_preemptions == e.preemptions {
                    return Err(broken!(
                        "request {:?}: output of step {} to drop is not stale or follows output \
                         to deliver",
                        r.spec.request_id,
                        step.step_id
                    ));
                }
            }
        }
        if num_dropped != self.num_dropped_in_flight {
            return Err(broken!(
                "{num_dropped} entries in flight are to be dropped but {} are counted",
                self.num_dropped_in_flight
            ));
        }
        for (slot, r) in self.store.iter() {
            let id = &r.spec.request_id;
            let s = slot as usize;
            if r.status != RequestStatus::Running && dropped[s] && delivered[s] {
                return Err(broken!(
                    "preempted request {id:?} has stale output both to drop and to deliver"
                ));
            }
            if r.num_in_flight_tokens != in_flight[slot as usize] {
                return Err(broken!(
                    "request {id:?} counts {} tokens in flight but its steps awaiting output \
                     scheduled {}",
                    r.num_in_flight_tokens,
                    in_flight[slot as usize]
                ));
            }
            // Computed positions are known tokens, plus what steps in flight will deliver: their
            // placeholders (async), and drafts that are not tokens yet (sync).
            let limit = r.num_tokens() + r.num_output_placeholders + drafts_in_flight[s];
            if r.num_computed_tokens > limit {
                return Err(broken!(
                    "request {id:?} has {} computed tokens but only {} tokens, {} output \
                     placeholders and {} drafts in flight",
                    r.num_computed_tokens,
                    r.num_tokens(),
                    r.num_output_placeholders,
                    drafts_in_flight[s]
                ));
            }
            let ph = r.num_output_placeholders;
            let allowed = self.config.async_scheduling && r.status == RequestStatus::Running;
            if ph > 0 && (!allowed || ph > r.num_in_flight_tokens) {
                return Err(broken!(
                    "request {id:?} ({:?}) has {ph} output placeholders with {} tokens in flight",
                    r.status,
                    r.num_in_flight_tokens
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::lookahead::SpecMethod;
    use crate::output::{StepOutput, UpdateOutput};
    use crate::requests::request::RequestSpec;
    use crate::{Scheduler, SchedulerConfig};

    #[test]
    fn computed_tokens_past_the_tokens_are_caught() {
        let mut c = SchedulerConfig::new(64, 16, 256, 8, 256);
        c.spec_method = SpecMethod::DFlash;
        c.num_speculative_tokens = 4;
        let mut s = Scheduler::new(c).unwrap();
        let spec = RequestSpec {
            request_id: "a".into(),
            prompt_token_ids: (1..16).collect(),
            max_tokens: 40,
            ..Default::default()
        };
        let slot = s.add_request(spec).unwrap();
        let mut out = StepOutput::default();
        s.schedule(&mut out).unwrap();
        s.update_from_output(out.step_id, &[7], &[1], &mut UpdateOutput::default())
            .unwrap();
        s.check_invariants().unwrap();
        // What an empty sample for a decode with 4 drafts left behind before it was refused.
        s.store.get_mut(slot).unwrap().num_computed_tokens += 4;
        let err = s.check_invariants().unwrap_err();
        assert!(err.to_string().contains("computed tokens"), "{err}");
    }
}
