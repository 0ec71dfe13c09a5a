//! Phase C of the step: lay the scheduled batch out in the block table, fill the step's output,
//! advance the requests' computed tokens and record the step as in flight.

use crate::error::{broken, CoreResult};
use crate::output::{EntryKind, StepOutput};
use crate::requests::request::Request;

use super::in_flight::{InFlightEntry, InFlightStep};
use super::{Scheduler, PLACEHOLDER_TOKEN};

impl Scheduler {
    /// Phase C: lay the batch out in the block table, fill `out`, advance computed tokens.
    pub(super) fn finish_step(
        &mut self,
        out: &mut StepOutput,
        scheduled_order: Vec<u32>,
    ) -> CoreResult<()> {
        let steps = &self.scratch.slots;
        self.rows.partition_scheduled(&mut self.store, |slot| {
            steps.get(slot as usize).is_some_and(|e| e.scheduled > 0)
        });
        debug_assert_eq!(
            self.rows
                .owners()
                .iter()
                .take_while(|&&s| self.scratch.slots[s as usize].scheduled > 0)
                .count(),
            scheduled_order.len()
        );
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        out.step_id = step_id;
        out.num_lookahead_tokens = self.lookahead_tokens();
        for (rank, &slot) in scheduled_order.iter().enumerate() {
            self.scratch.slots[slot as usize].rank = rank as u32;
        }
        let n = scheduled_order.len();
        out.slots.extend_from_slice(&self.rows.owners()[..n]);
        let steps = &self.scratch.slots;
        for &slot in &out.slots {
            out.kinds.push(
                steps[slot as usize]
                    .kind
                    .ok_or_else(|| broken!("scheduled slot {slot} without kind"))?,
            );
        }
        out.reserve_entries(n);
        out.query_start_loc.push(0);
        let mut total = 0i32;
        let mut entries = Vec::with_capacity(n);
        let (async_scheduling, k) = (
            self.config.async_scheduling,
            self.config.num_speculative_tokens,
        );
        for &slot in &out.slots {
            let e = self.scratch.slots[slot as usize];
            let (num_new, num_spec) = (e.scheduled as usize, e.num_spec as usize);
            total += num_new as i32;
            out.num_scheduled_tokens.push(num_new as i32);
            out.num_computed_tokens.push(e.computed_before as i32);
            out.num_spec_tokens.push(e.num_spec);
            out.query_start_loc.push(total);
            let (generation, r) = self.store.get_mut_with_generation(slot)?;
            r.num_computed_tokens += num_new;
            r.num_in_flight_tokens += num_new;
            let was_prefill_chunk = r.is_prefill_chunk;
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens() + r.num_output_placeholders;
            out.num_output_placeholders
                .push(r.num_output_placeholders as u32);
            out.is_prefill_chunk.push(r.is_prefill_chunk);
            let new_blocks = &r.blocks.block_ids[e.new_blocks_start as usize..];
            if !new_blocks.is_empty() {
                out.new_block_ids.extend_from_slice(new_blocks);
            }
            out.num_new_blocks.push(new_blocks.len() as u32);
            out.generations.push(generation);
            let spec = r
                .spec_token_ids
                .get(..num_spec)
                .ok_or_else(|| broken!("scheduled drafts of slot {slot} went missing"))?;
            out.spec_token_ids.extend_from_slice(spec);
            r.spec_token_ids.clear();
            entries.push(InFlightEntry {
                slot,
                generation,
                rank: e.rank,
                num_spec_tokens: num_spec as u32,
                is_prefill_chunk: r.is_prefill_chunk,
                num_scheduled: num_new as u32,
                preemptions: r.num_preemptions,
                drop_output: false,
                was_prefill_chunk,
                admitted: e.kind != Some(EntryKind::Running),
                cached_before: e.cached_before,
            });
            if async_scheduling && !r.is_prefill_chunk {
                add_output_placeholders(r, num_spec, k);
            }
        }
        for &slot in &out.slots {
            let e = &mut self.scratch.slots[slot as usize];
            e.scheduled = 0;
            e.kind = None;
        }
        out.total_num_scheduled_tokens = total as usize;
        out.finished_req_ids.append(&mut self.finished_ids);
        out.scheduler_uid = self.uid;
        if !entries.is_empty() {
            self.in_flight.push_back(InFlightStep { step_id, entries });
        }
        self.stats.num_steps += 1;
        Ok(())
    }
}

/// Async scheduling, after `r` was scheduled in a step that samples: the step's sampled token
/// and its `num_spec` drafts become output placeholders, and the next step gets `k`
/// placeholder drafts (the runner proposes the real ones after this step is planned).
fn add_output_placeholders(r: &mut Request, num_spec: usize, k: usize) {
    r.num_output_placeholders += 1 + num_spec;
    r.spec_token_ids.clear();
    r.spec_token_ids.resize(k, PLACEHOLDER_TOKEN);
}
