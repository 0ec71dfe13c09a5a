//! Applying the model's output to the scheduler: rejected drafts, accepted tokens, stops.

use crate::error::{broken, invalid, CoreError, CoreResult};
use crate::output::{RequestUpdate, UpdateOutput};
use crate::requests::kv_view::SequenceView;
use crate::requests::request::{FinishReason, RequestStatus};
use crate::semantics::VllmSemantics;

use super::Scheduler;

impl Scheduler {
    /// Applies the model's sampled tokens for step `step_id` (the oldest step in flight):
    /// `counts[i]` tokens for batch entry `i`, flat in `tokens`. Rolls back rejected drafts,
    /// appends accepted tokens with stop checks, and finishes stopped requests. `out.ended`
    /// reports the requests the scheduler ended on its own since the previous successful
    /// update (an update that fails keeps them for the next one).
    pub fn update_from_output(
        &mut self,
        step_id: u64,
        tokens: &[u32],
        counts: &[u32],
        out: &mut UpdateOutput,
    ) -> CoreResult<()> {
        crate::fault::hit("update.begin")?;
        out.updates.clear();
        out.new_token_ids.clear();
        out.ended.clear();
        if self.is_abandoned(step_id) {
            return Err(CoreError::State(format!(
                "step {step_id} was abandoned (abandon_step): its output can no longer be applied"
            )));
        }
        if counts.is_empty()
            && tokens.is_empty()
            && self.in_flight.front().is_none_or(|s| s.step_id != step_id)
        {
            out.ended.append(&mut self.ended_unreported);
            return Ok(()); // an empty step awaits no output
        }
        let Some(step) = self.in_flight.front() else {
            return Err(CoreError::State(format!(
                "no step is awaiting output (step {step_id} was already applied, or schedule() was not called)"
            )));
        };
        if step.step_id != step_id {
            return Err(CoreError::State(if step_id < step.step_id {
                format!("the output of step {step_id} was already applied")
            } else {
                format!("outputs must be applied in order: step {} is still awaiting output, got step {step_id}", step.step_id)
            }));
        }
        if counts.len() != step.entries.len() {
            return Err(invalid!(
                "the model output has {} requests but step {step_id} scheduled {}",
                counts.len(),
                step.entries.len()
            ));
        }
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if total != tokens.len() {
            return Err(invalid!(
                "sampled counts sum to {total} but {} tokens were given",
                tokens.len()
            ));
        }
        for (i, (e, &c)) in step.entries.iter().zip(counts).enumerate() {
            if c > e.num_spec_tokens + 1 {
                return Err(invalid!(
                    "request at batch index {i} sampled {c} tokens but only {} can be accepted (1 + {} drafts)",
                    e.num_spec_tokens + 1,
                    e.num_spec_tokens
                ));
            }
            if c == 0 && !e.is_prefill_chunk && !e.drop_output {
                // A step that verifies drafts samples at least the bonus token. With none, the
                // drafts' rollback (rejected = drafts - (sampled - 1)) is undefined, and vLLM
                // skips it, leaving num_computed_tokens past the tokens: the request is never
                // scheduled again. Under async scheduling its placeholders would never resolve.
                if self.config.async_scheduling {
                    return Err(invalid!(
                        "request at batch index {i} finished its prefill or decoded in this step \
                         but sampled no token (async scheduling counts on one)"
                    ));
                }
                if e.num_spec_tokens > 0 {
                    return Err(invalid!(
                        "request at batch index {i} verified {} draft tokens but sampled no token \
                         (a decode step samples at least one)",
                        e.num_spec_tokens
                    ));
                }
            }
        }
        let step = self
            .in_flight
            .pop_front()
            .ok_or_else(|| broken!("in-flight step vanished"))?;
        let max_model_len = self.config.max_model_len;
        let v0_32 = self.config.vllm_semantics == VllmSemantics::V0_32;
        let cache_at_update = self.config.num_speculative_tokens > 0 && !v0_32;
        let async_scheduling = self.config.async_scheduling;
        let mut finished: Vec<(u32, u32, FinishReason)> = Vec::new();
        let mut to_cache = std::mem::take(&mut self.scratch.to_cache);
        to_cache.clear();
        let mut tally = std::mem::take(&mut self.scratch.tally);
        tally.start(self.stats.num_accepted_tokens_per_pos.len());
        let block_size = self.config.block_size;
        let mut cache_hashes = std::mem::take(&mut self.scratch.cache_hashes);
        cache_hashes.clear();
        let mut start = 0usize;
        for (i, (e, &count)) in step.entries.iter().zip(counts).enumerate() {
            let ahead = i + crate::memory::prefetch::DISTANCE;
            if let (Some(next), Some(&n)) = (step.entries.get(ahead), counts.get(ahead)) {
                self.store
                    .prefetch_for_update(next.slot, n as usize, block_size);
            }
            let sampled = &tokens[start..start + count as usize];
            start += count as usize;
            if e.drop_output {
                self.num_dropped_in_flight -= 1;
            }
            let Some(r) = self.store.get_mut_if_current(e.slot, e.generation) else {
                continue;
            };
            r.num_in_flight_tokens = r
                .num_in_flight_tokens
                .saturating_sub(e.num_scheduled as usize);
            // Scheduled before the request's latest preemption: the tokens are still delivered,
            // but the counters they would adjust were reset (vLLM 0.33's stale output).
            let stale = r.num_preemptions != e.preemptions;
            // Stale output of a request preempted by `preempt_all_running` with
            // `drop_stale_outputs`: dropped whole (no token, no stat), as vLLM 0.33 does.
            if r.is_finished() || sampled.is_empty() || e.is_prefill_chunk || e.drop_output {
                continue;
            }
            if e.num_spec_tokens > 0 {
                let accepted = sampled.len() as u32 - 1;
                let rejected = e.num_spec_tokens - accepted;
                if !stale {
                    if r.num_computed_tokens > 0 {
                        r.num_computed_tokens -= rejected as usize;
                    }
                    r.num_output_placeholders =
                        r.num_output_placeholders.saturating_sub(rejected as usize);
                }
                tally.count(e.num_spec_tokens, accepted);
                if let Some(c) = self
                    .stats
                    .num_drafts_by_count
                    .get_mut(e.num_spec_tokens as usize)
                {
                    *c += 1;
                }
            }
            let tokens_start = out.new_token_ids.len() as u32;
            let was_running = r.status == RequestStatus::Running;
            let had_placeholders = r.num_output_placeholders > 0;
            let (kept, finish) = r.append_outputs(sampled, max_model_len, self.hasher.as_ref());
            out.new_token_ids.extend_from_slice(&sampled[..kept]);
            // Tokens after a stop are discarded; so is their claim to computed KV (vLLM 0.33
            // trims num_computed_tokens the same way before caching blocks; 0.32 keeps it and
            // resolves only the kept tokens' placeholders).
            if !stale {
                if v0_32 {
                    r.num_output_placeholders = r.num_output_placeholders.saturating_sub(kept);
                } else {
                    r.num_computed_tokens -= (sampled.len() - kept).min(r.num_computed_tokens);
                    r.num_output_placeholders =
                        r.num_output_placeholders.saturating_sub(sampled.len());
                }
            }
            // vLLM 0.32 registers blocks here only under async scheduling (its AsyncScheduler),
            // stale output of a request running again included, up to the tokens no
            // placeholder holds.
            let cache_now = if v0_32 {
                async_scheduling && was_running
            } else {
                (cache_at_update || had_placeholders) && was_running && !stale
            };
            if cache_now {
                // As vLLM 0.33 does with speculative decoding: register the blocks that the
                // accepted tokens filled now, not at the next allocation, so they stay
                // cached if the request is preempted or finishes before that. Registered in a
                // second pass below, in batch order: each registration reads pool lines the
                // engine's work has evicted, which this pass prefetches for all of them. The
                // prefetch reaches one token further, to the end of the known tokens: a block
                // that the last sampled token completes is registered by the next allocation,
                // whose lines are then already cached.
                let not_done = if v0_32 {
                    r.num_output_placeholders
                } else {
                    r.num_in_flight_tokens
                };
                let done = r.num_computed_tokens.saturating_sub(not_done);
                if self.kv.prefetch_cache_blocks_noting(
                    &r.blocks,
                    r.sequence(),
                    r.num_tokens(),
                    &mut cache_hashes,
                ) {
                    to_cache.push((e.rank, e.slot, done));
                }
            }
            let stop_token = r.stop_token;
            out.updates.push(RequestUpdate {
                slot: e.slot,
                tokens_start,
                tokens_end: out.new_token_ids.len() as u32,
                finish_reason: finish,
                stop_token,
            });
            if let Some(reason) = finish {
                finished.push((e.rank, e.slot, reason));
            }
        }
        tally.add_to(&mut self.stats);
        self.scratch.tally = tally;
        // Registered in scheduling order, as vLLM registers them (it walks the step's
        // requests in that order): the order of blocks under one hash, and of KV events.
        to_cache.sort_unstable_by_key(|&(rank, _, _)| rank);
        self.kv.prefetch_chains(&cache_hashes);
        self.scratch.cache_hashes = cache_hashes;
        for &(_, slot, done) in &to_cache {
            let r = self.store.get_mut(slot)?;
            let seq = SequenceView {
                tokens: &r.tokens,
                block_hashes: &r.block_hashes,
                extra: &r.spec.extra,
            };
            self.kv.cache_blocks(&mut r.blocks, seq, done);
            if self.kv.kv_events_on() {
                self.kv.attribute_kv_events(&r.spec.request_id);
            }
        }
        self.scratch.to_cache = to_cache;
        // Free finished requests in scheduling order, as vLLM does: the order decides the free
        // queue's order and so which blocks later requests get.
        finished.sort_unstable_by_key(|&(rank, _, _)| rank);
        for (_, slot, reason) in finished {
            self.finish(slot, reason)?;
        }
        out.ended.append(&mut self.ended_unreported);
        Ok(())
    }
}
