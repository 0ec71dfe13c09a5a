//! Phase A of the step: running requests get their next tokens, in running order; when the pool
//! is short, a victim (FCFS: the last running; priority: the lowest priority, latest arrival) is
//! preempted back to the front of the waiting queue.

use crate::error::{broken, CoreResult};
use crate::lookahead::AllocationKind;
use crate::output::{EntryKind, StepOutput};
use crate::requests::queue::Policy;
use crate::requests::request::RequestStatus;
use crate::semantics::VllmSemantics;

use super::admission::priority_key;
use super::budget::StepBudget;
use super::Scheduler;

impl Scheduler {
    /// Phase A: running requests, in running order. Returns whether a request in the middle of
    /// its prefill was scheduled.
    pub(super) fn schedule_running(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        preempted_any: &mut bool,
        hold_prefills: bool,
        out: &mut StepOutput,
    ) -> CoreResult<bool> {
        let mut prefill_scheduled = false;
        if self.running_phase_registers_blocks() {
            self.prefetch_running_registrations(*budget);
        }
        let lookahead = self.lookahead_for(AllocationKind::Running);
        let threshold = self.config.long_prefill_token_threshold;
        let max_model_len = self.config.max_model_len;
        let mut index = 0;
        while index < self.running.len() && budget.can_schedule() {
            // Running order mostly follows row order: the row a few requests ahead is where a
            // new block of theirs will be written (a hint; a wrong row costs nothing).
            self.rows
                .prefetch_append(index + crate::memory::prefetch::DISTANCE);
            let slot = self.running[index];
            let (r, row) = self.store.get_mut_with_row(slot)?;
            if r.in_flight_reaches_max_tokens() || (hold_prefills && r.is_prefill_chunk) {
                // Held back: its next prefill chunk waits for a step that carries prefills.
                index += 1;
                continue;
            }
            let computed = r.num_computed_tokens;
            let placeholders = r.num_output_placeholders;
            let mut num_new = r.num_tokens_to_compute();
            if threshold > 0 && num_new > threshold {
                num_new = threshold;
            }
            // Every input position stays <= max_model_len - 2 (room for the sampled token), but
            // the known tokens may always be computed: a prompt of exactly max_model_len must
            // finish its prefill instead of waiting forever for its last token.
            let length_cap = max_model_len
                .saturating_sub(1 + computed)
                .max(r.num_tokens().saturating_sub(computed));
            num_new = num_new.min(budget.cap()).min(length_cap);
            if num_new == 0 {
                index += 1;
                continue;
            }
            self.scratch.slots[slot as usize].cached_before = r.blocks.num_cached_blocks as u32;
            let seq = crate::requests::kv_view::SequenceView {
                tokens: &r.tokens,
                block_hashes: &r.block_hashes,
                extra: &r.spec.extra,
            };
            let allocated =
                self.kv
                    .extend_slots(&mut r.blocks, seq, num_new, computed, lookahead)?;
            let (r, row, first_new) = match allocated {
                Some(first_new) => {
                    if self.kv.kv_events_on() {
                        self.kv.attribute_kv_events(&r.spec.request_id);
                    }
                    (r, row, first_new)
                }
                None => {
                    let allocated = self.allocate_preempting(
                        slot,
                        (num_new, computed, lookahead),
                        &mut index,
                        budget,
                        scheduled_order,
                        preempted_any,
                        out,
                    )?;
                    let Some(first_new) = allocated else {
                        if self.store.slot_of_generation(slot).is_none() {
                            // Ended: the pool can never hold it; `running` is empty now.
                            break;
                        }
                        if self.config.policy == Policy::Priority
                            && self.config.vllm_semantics == VllmSemantics::V0_33
                        {
                            // The current request preempted itself; try the next one (vLLM
                            // 0.33; 0.32 ends the running phase here).
                            continue;
                        }
                        break;
                    };
                    // Preemptions moved rows: the row is read again.
                    let (r, row) = self.store.get_mut_with_row(slot)?;
                    (r, row, first_new)
                }
            };
            if let Some(row) = row {
                self.rows
                    .append(row as usize, &r.blocks.block_ids[first_new..]);
            }
            let num_spec = (num_new + computed).saturating_sub(r.num_tokens() + placeholders);
            r.spec_token_ids.truncate(num_spec);
            let e = &mut self.scratch.slots[slot as usize];
            e.scheduled = num_new as u32;
            e.kind = Some(EntryKind::Running);
            e.new_blocks_start = first_new as u32;
            e.computed_before = computed as u32;
            e.num_spec = r.spec_token_ids.len() as u32;
            prefill_scheduled |= r.is_prefill_chunk;
            scheduled_order.push(slot);
            budget.take(num_new);
            index += 1;
        }
        Ok(prefill_scheduled)
    }

    /// Whether this phase's allocations register the blocks that the previous step's tokens
    /// filled: with prefix caching on, unless `update_from_output` registers them (with
    /// speculative decoding in vLLM 0.33, and under async scheduling).
    fn running_phase_registers_blocks(&self) -> bool {
        let v0_32 = self.config.vllm_semantics == VllmSemantics::V0_32;
        let update_registers =
            self.config.async_scheduling || (self.config.num_speculative_tokens > 0 && !v0_32);
        self.kv.pool().caching_enabled() && !update_registers
    }

    /// Asks for the pool lines that this phase's registrations will touch, for every running
    /// request at once, before the loop that allocates. A registration reads the block's id
    /// and hash in the request's vectors, then the block's record and its hash bucket, then
    /// the record it links after; the engine's work has evicted them all. One request at a
    /// time those misses would not overlap; here each wave asks for a line of every
    /// registering request (as `update_from_output` does where it registers). It stops where
    /// `budget` would run out if each request got all its tokens, as the loop stops there (the
    /// loop may cap a request's tokens and reach further; its misses are then its own).
    fn prefetch_running_registrations(&mut self, mut budget: StepBudget) {
        let mut registering = std::mem::take(&mut self.scratch.registering);
        registering.clear();
        for &slot in &self.running {
            if !budget.can_schedule() {
                break;
            }
            let Ok(r) = self.store.get(slot) else {
                continue;
            };
            budget.take(r.num_tokens_to_compute().min(budget.cap()));
            if self
                .kv
                .registers_on_next_allocation(&r.blocks, r.sequence())
            {
                registering.push(slot);
            }
        }
        if !registering.is_empty() {
            let mut hashes = std::mem::take(&mut self.scratch.cache_hashes);
            hashes.clear();
            for &slot in &registering {
                if let Ok(r) = self.store.get(slot) {
                    let seq = r.sequence();
                    self.kv.prefetch_cache_blocks_noting(
                        &r.blocks,
                        seq,
                        seq.num_tokens(),
                        &mut hashes,
                    );
                }
            }
            self.kv.prefetch_chains(&hashes);
            self.scratch.cache_hashes = hashes;
        }
        self.scratch.registering = registering;
    }

    /// After the pool could not give `slot` (at `index` in `running`) the slots for
    /// `(num_new, computed, lookahead)` tokens: preempts victims until the allocation succeeds
    /// (the first new block's index), the request itself is preempted, or it is alone and can
    /// never fit (ended; `None` both).
    #[allow(clippy::too_many_arguments)]
    fn allocate_preempting(
        &mut self,
        slot: u32,
        (num_new, computed, lookahead): (usize, usize, usize),
        index: &mut usize,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        preempted_any: &mut bool,
        out: &mut StepOutput,
    ) -> CoreResult<Option<usize>> {
        loop {
            if self.running.len() == 1 {
                // Alone and still short: the pool can never hold this request. End it
                // instead of letting it preempt itself forever.
                self.end_unservable(slot)?;
                return Ok(None);
            }
            let victim_index = self.pick_victim()?;
            let victim = self.running.remove(victim_index);
            *preempted_any = true;
            if victim_index < *index {
                // Priority policy: the victim was already scheduled this step; undo it, and
                // take back the prefix-cache entries it registered for KV never computed.
                let v = self.scratch.slots[victim as usize];
                budget.give_back(v.scheduled as usize);
                let cached_before = v.cached_before as usize;
                self.scratch.unschedule(victim);
                scheduled_order.retain(|&s| s != victim);
                *index -= 1;
                let v = self.store.get_mut(victim)?;
                self.kv.uncache_blocks(&mut v.blocks, cached_before);
            }
            self.preempt(victim, out)?;
            if victim == slot {
                return Ok(None);
            }
            let r = self.store.get_mut(slot)?;
            let seq = crate::requests::kv_view::SequenceView {
                tokens: &r.tokens,
                block_hashes: &r.block_hashes,
                extra: &r.spec.extra,
            };
            if let Some(first_new) =
                self.kv
                    .extend_slots(&mut r.blocks, seq, num_new, computed, lookahead)?
            {
                if self.kv.kv_events_on() {
                    self.kv.attribute_kv_events(&r.spec.request_id);
                }
                return Ok(Some(first_new));
            }
        }
    }

    /// Index in `running` of the request to preempt.
    fn pick_victim(&self) -> CoreResult<usize> {
        if self.running.is_empty() {
            return Err(broken!(
                "allocation failed with no running request to preempt"
            ));
        }
        match self.config.policy {
            Policy::Fcfs => Ok(self.running.len() - 1),
            Policy::Priority => {
                let mut best = 0;
                let mut best_key = priority_key(self.store.get(self.running[0])?);
                for (i, &slot) in self.running.iter().enumerate().skip(1) {
                    let key = priority_key(self.store.get(slot)?);
                    // Largest key = lowest priority, latest arrival.
                    if key.cmp_key(&best_key).is_ge() {
                        best = i;
                        best_key = key;
                    }
                }
                Ok(best)
            }
        }
    }

    /// Recompute preemption: free the blocks (full ones stay cached), reset progress, back to
    /// the front of the waiting queue. The caller already removed it from `running`.
    pub(super) fn preempt(&mut self, slot: u32, out: &mut StepOutput) -> CoreResult<()> {
        self.keep_dropping_stale_output(slot);
        self.rows.remove(&mut self.store, slot);
        let r = self.store.get_mut(slot)?;
        self.kv.free(&mut r.blocks);
        r.status = RequestStatus::Preempted;
        r.num_computed_tokens = 0;
        r.num_output_placeholders = 0;
        r.spec_token_ids.clear();
        r.is_prefill_chunk = false;
        r.num_preemptions += 1;
        out.preempted_req_ids.push(r.spec.request_id.clone());
        let key = priority_key(r);
        self.waiting.push_front(slot, key);
        self.stats.num_preemptions += 1;
        Ok(())
    }
}
