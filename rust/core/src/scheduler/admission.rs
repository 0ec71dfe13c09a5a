//! Requests in: `add_request` validates and enqueues, and phase B of the step admits waiting
//! requests in queue order, passing over those that must wait (admission hold, stale output in
//! flight, `max_loras`).

use crate::error::{invalid, CoreError, CoreResult};
use crate::kv_manager::AllocateArgs;
use crate::lookahead::AllocationKind;
use crate::output::EntryKind;
use crate::requests::queue::PriorityKey;
use crate::requests::request::{Request, RequestSpec, RequestStatus};
use crate::semantics::VllmSemantics;

use super::budget::StepBudget;
use super::cadence::StepPrefills;
use super::{Scheduler, PLACEHOLDER_TOKEN};

impl Scheduler {
    /// Validates and enqueues a request; returns its slot.
    pub fn add_request(&mut self, spec: RequestSpec) -> CoreResult<u32> {
        crate::fault::hit("add_request.begin")?;
        if spec.request_id.is_empty() {
            return Err(invalid!("request_id must be a non-empty string"));
        }
        if self.store.slot_of(&spec.request_id).is_some() {
            return Err(CoreError::DuplicateRequest(spec.request_id));
        }
        if spec.prompt_token_ids.is_empty() {
            return Err(invalid!(
                "request {:?}: prompt_token_ids must not be empty",
                spec.request_id
            ));
        }
        if spec.prompt_token_ids.len() > self.config.max_model_len {
            return Err(CoreError::TooLong(format!(
                "request {:?}: prompt of {} tokens exceeds max_model_len {}",
                spec.request_id,
                spec.prompt_token_ids.len(),
                self.config.max_model_len
            )));
        }
        // Its last prefill step writes the whole prompt plus the method's lookahead; a request
        // the whole pool cannot hold would wait at the queue head forever.
        let lookahead = self.lookahead_for(AllocationKind::Admission {
            num_computed_tokens: 0,
        });
        let slots = (spec.prompt_token_ids.len() + lookahead).min(self.config.max_model_len);
        let prompt_blocks = slots.div_ceil(self.config.block_size);
        if prompt_blocks > self.kv.pool().num_usable_blocks() {
            return Err(CoreError::OutOfBlocks(format!(
                "request {:?}: its prompt ({} tokens) plus {lookahead} lookahead slots needs \
                 {prompt_blocks} KV blocks but the pool has only {}",
                spec.request_id,
                spec.prompt_token_ids.len(),
                self.kv.pool().num_usable_blocks()
            )));
        }
        if spec.max_tokens == 0 {
            return Err(invalid!(
                "request {:?}: max_tokens must be >= 1",
                spec.request_id
            ));
        }
        if !spec.arrival_time.is_finite() {
            return Err(invalid!(
                "request {:?}: arrival_time must be finite",
                spec.request_id
            ));
        }
        let seq = self.next_arrival_seq;
        self.next_arrival_seq += 1;
        let request = Request::new(spec, seq, self.hasher.as_ref(), self.config.max_model_len);
        let key = priority_key(&request);
        let slot = self.store.insert(request)?;
        self.waiting.push_back(slot, key);
        Ok(slot)
    }

    /// Phase B: waiting requests, strict FCFS (or priority) admission. A preempted request
    /// whose stale output is still in flight is passed over and keeps its place. Returns
    /// whether a request was admitted with more than one token left to compute (a prefill).
    pub(super) fn schedule_waiting(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        prefills: StepPrefills,
    ) -> CoreResult<bool> {
        let mut passed_over = Vec::new();
        let result = self.admit_waiting(budget, scheduled_order, prefills, &mut passed_over);
        for &slot in passed_over.iter().rev() {
            let key = priority_key(self.store.get(slot)?);
            self.waiting.push_front(slot, key);
        }
        result
    }

    /// Admits queue heads while the budget and `max_num_seqs` allow; those that must wait are
    /// taken out into `passed_over`. Returns whether a prefill was admitted.
    fn admit_waiting(
        &mut self,
        budget: &mut StepBudget,
        scheduled_order: &mut Vec<u32>,
        prefills: StepPrefills,
        passed_over: &mut Vec<u32>,
    ) -> CoreResult<bool> {
        let prefill_scheduled = prefills.scheduled;
        let mut prefill_admitted = false;
        let num_running_scheduled = scheduled_order.len();
        // The LoRA adapters of the step's requests, built at the first waiting LoRA request.
        let mut scheduled_loras: Option<Vec<u32>> = None;
        while budget.can_schedule() && self.running.len() < self.config.max_num_seqs {
            let Some(slot) = self.waiting.peek() else {
                break;
            };
            let lora_id = self.counted_lora(self.store.get(slot)?);
            if self.must_wait(slot, lora_id, scheduled_order, &mut scheduled_loras)? {
                self.pass_over(slot, passed_over)?;
                continue;
            }
            let r = self.store.get(slot)?;
            let computed_before_hits = r.num_computed_tokens;
            let reads_cache = !r.spec.skip_reading_prefix_cache;
            let hit_tokens = if reads_cache {
                self.kv
                    .get_computed_blocks(r.sequence(), &mut self.scratch.hits)
            } else {
                self.scratch.hits.clear();
                0
            };
            // vLLM's rule for a prefill: more than one token left after the hit.
            let needs_prefill = hit_tokens + 1 < r.num_tokens();
            if prefills.hold && needs_prefill {
                break; // held back until a step that carries prefills (`cadence.rs`)
            }
            let Some((num_new, pad)) = self.admission_size(
                r.num_tokens() - hit_tokens,
                hit_tokens,
                budget.cap(),
                prefill_scheduled,
                num_running_scheduled,
            ) else {
                break;
            };
            let lookahead = self.lookahead_for(AllocationKind::Admission {
                num_computed_tokens: computed_before_hits,
            });
            let r = self.store.get_mut(slot)?;
            let seq = crate::requests::kv_view::SequenceView {
                tokens: &r.tokens,
                block_hashes: &r.block_hashes,
                extra: &r.spec.extra,
            };
            let args = AllocateArgs {
                num_new_tokens: num_new,
                num_computed_tokens: 0,
                num_new_computed_tokens: hit_tokens,
                new_computed_blocks: &self.scratch.hits,
                num_lookahead_tokens: lookahead,
                full_sequence_must_fit: true,
            };
            // The hits come from `get_computed_blocks` on this sequence above, and nothing has
            // changed the pool since.
            if self
                .kv
                .allocate_slots_after_lookup(&mut r.blocks, seq, args)?
                .is_none()
            {
                if self.running.is_empty() {
                    // Nothing holds a block, yet it does not fit (a resumed request that grew
                    // past the pool): it never will. End it rather than block the queue.
                    self.end_unservable(slot)?;
                    continue;
                }
                break;
            }
            if self.kv.kv_events_on() {
                self.kv.attribute_kv_events(&r.spec.request_id);
            }
            if let Some(loras) = scheduled_loras.as_mut().filter(|_| lora_id != 0) {
                if !loras.contains(&lora_id) {
                    loras.push(lora_id);
                }
            }
            self.admit(slot, num_new, hit_tokens, reads_cache, pad)?;
            scheduled_order.push(slot);
            budget.take(num_new);
            prefill_admitted |= needs_prefill;
        }
        Ok(prefill_admitted)
    }

    /// The adapter `r` counts against `max_loras` (0: none, or no limit configured).
    fn counted_lora(&self, r: &Request) -> u32 {
        if self.config.max_loras > 0 {
            r.spec.lora_id
        } else {
            0
        }
    }

    /// Whether the queue head `slot` must wait this step, keeping its place: held back
    /// (`hold.rs`), its stale output still to come, or its adapter `lora_id` past `max_loras`
    /// among `scheduled_loras` (built here at the first LoRA request).
    fn must_wait(
        &mut self,
        slot: u32,
        lora_id: u32,
        scheduled_order: &[u32],
        scheduled_loras: &mut Option<Vec<u32>>,
    ) -> CoreResult<bool> {
        let r = self.store.get(slot)?;
        if r.admission_hold {
            // As vLLM's blocked statuses (a grammar still compiling): checked first.
            self.held_passed_over.push(slot);
            return Ok(true);
        }
        if r.status == RequestStatus::Preempted
            && r.num_in_flight_tokens > 0
            && !self.drops_stale_output(slot)
        {
            // As vLLM 0.33: output of a step scheduled before its preemption is still to
            // come; resuming now could recompute positions that output delivers later.
            // (Output to be dropped delivers nothing: such a request resumes at once.)
            return Ok(true);
        }
        if lora_id != 0 {
            if scheduled_loras.is_none() {
                // vLLM 0.33 counts every running request's adapter (an unscheduled one may
                // join a later batch); 0.32 those of the running requests it scheduled.
                let counted = match self.config.vllm_semantics {
                    VllmSemantics::V0_32 => scheduled_order,
                    VllmSemantics::V0_33 => self.running.as_slice(),
                };
                *scheduled_loras = Some(self.loras_of(counted)?);
            }
            let max_loras = self.config.max_loras;
            let at_limit = scheduled_loras
                .as_ref()
                .is_some_and(|l| l.len() >= max_loras && !l.contains(&lora_id));
            if at_limit {
                // As vLLM: admitting it would exceed max_loras; it keeps its place.
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Tokens to schedule for an admission with `num_new` tokens left after its `hit_tokens`
    /// prefix hit, within `cap`, and whether it is padded to a 1 + K decode; `None` when
    /// admission stops at it.
    fn admission_size(
        &self,
        mut num_new: usize,
        hit_tokens: usize,
        cap: usize,
        prefill_scheduled: bool,
        num_running_scheduled: usize,
    ) -> Option<(usize, bool)> {
        let threshold = self.config.long_prefill_token_threshold;
        let k = self.config.num_speculative_tokens;
        // vLLM 0.33 (opt-in here): an admission with one token left to compute (a resume, a
        // full prefix hit) joins a decode batch as a uniform 1 + K decode with K placeholder
        // drafts, so the batch keeps one shape (CUDA graphs).
        let pad = self.config.pad_admitted_decodes
            && k > 0
            && num_new == 1
            && !prefill_scheduled
            && (num_running_scheduled > 0 || hit_tokens > 0)
            && hit_tokens + 1 + k < self.config.max_model_len // room for the sampled token
            && (threshold == 0 || threshold > k);
        let pad = pad && {
            if 1 + k > cap && num_running_scheduled > 0 {
                return None; // vLLM: rather not schedule it than schedule it unpadded
            }
            // Alone, a budget below 1 + K would block it forever: schedule it unpadded.
            k < cap
        };
        if pad {
            num_new = 1 + k;
        }
        if threshold > 0 && num_new > threshold {
            num_new = threshold;
        }
        if !self.config.enable_chunked_prefill && num_new > cap {
            return None;
        }
        Some((num_new.min(cap), pad))
    }

    /// Admits the queue head `slot`, allocated for `num_new` tokens after its `hit_tokens`
    /// prefix hit: off the queue, into `running` and the block table, scheduled in the step's
    /// scratch (with K placeholder drafts if `pad`).
    fn admit(
        &mut self,
        slot: u32,
        num_new: usize,
        hit_tokens: usize,
        reads_cache: bool,
        pad: bool,
    ) -> CoreResult<()> {
        self.waiting.pop();
        let r = self.store.get_mut(slot)?;
        if r.deferred {
            r.deferred = false;
            self.num_deferred -= 1;
        }
        let kind = if r.status == RequestStatus::Preempted {
            EntryKind::Resumed
        } else {
            EntryKind::New
        };
        if self.config.enable_prefix_caching && reads_cache {
            let stats = if r.num_preemptions > 0 {
                &mut self.stats.resumed_prefix
            } else {
                &mut self.stats.admitted_prefix
            };
            stats.requests += 1;
            stats.queries += r.num_tokens() as u64;
            stats.hits += hit_tokens as u64;
        }
        r.status = RequestStatus::Running;
        r.num_computed_tokens = hit_tokens;
        let blocks = std::mem::take(&mut r.blocks.block_ids);
        self.rows.add(&mut self.store, slot, &blocks);
        self.store.get_mut(slot)?.blocks.block_ids = blocks;
        self.running.push(slot);
        let e = &mut self.scratch.slots[slot as usize];
        e.scheduled = num_new as u32;
        e.kind = Some(kind);
        e.new_blocks_start = 0;
        e.computed_before = hit_tokens as u32;
        e.cached_before = (hit_tokens / self.config.block_size) as u32;
        let r = self.store.get_mut(slot)?;
        r.spec_token_ids.clear();
        if pad {
            r.spec_token_ids
                .resize(self.config.num_speculative_tokens, PLACEHOLDER_TOKEN);
        }
        self.scratch.slots[slot as usize].num_spec = r.spec_token_ids.len() as u32;
        Ok(())
    }

    /// Takes the queue head `slot` out for this step (it goes back to the front after it),
    /// marking it deferred.
    fn pass_over(&mut self, slot: u32, passed_over: &mut Vec<u32>) -> CoreResult<()> {
        self.waiting.pop();
        passed_over.push(slot);
        let r = self.store.get_mut(slot)?;
        if !r.deferred {
            r.deferred = true;
            self.num_deferred += 1;
        }
        Ok(())
    }

    /// The distinct LoRA adapters (ids) of the requests in `slots`.
    fn loras_of(&self, scheduled: &[u32]) -> CoreResult<Vec<u32>> {
        let mut loras = Vec::new();
        for &slot in scheduled {
            let id = self.store.get(slot)?.spec.lora_id;
            if id != 0 && !loras.contains(&id) {
                loras.push(id);
            }
        }
        Ok(loras)
    }
}

/// The waiting-queue key of `r`.
pub(super) fn priority_key(r: &Request) -> PriorityKey {
    PriorityKey {
        priority: r.spec.priority,
        arrival_time: r.spec.arrival_time,
        arrival_seq: r.arrival_seq,
    }
}
