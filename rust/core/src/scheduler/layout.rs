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
        let scheduled = &self.scratch.scheduled;
        self.rows.partition_scheduled(&mut self.store, |slot| {
            scheduled.get(slot as usize).is_some_and(|&n| n > 0)
        });
        debug_assert_eq!(
            self.rows
                .owners()
                .iter()
                .take_while(|&&s| self.scratch.scheduled[s as usize] > 0)
                .count(),
            scheduled_order.len()
        );
        let step_id = self.next_step_id;
        self.next_step_id += 1;
        out.step_id = step_id;
        out.num_lookahead_tokens = self.lookahead_tokens();
        for (rank, &slot) in scheduled_order.iter().enumerate() {
            self.scratch.rank[slot as usize] = rank as u32;
        }
        let n = scheduled_order.len();
        let StepOutput {
            slots,
            kinds,
            num_scheduled_tokens,
            num_computed_tokens,
            num_output_placeholders,
            query_start_loc,
            is_prefill_chunk,
            new_block_ids,
            num_new_blocks,
            generations,
            spec_token_ids,
            num_spec_tokens,
            ..
        } = out;
        // Columns that come from the step's scratch arrays, one tight pass each; then one pass
        // over the requests for what their records hold.
        slots.extend_from_slice(&self.rows.owners()[..n]);
        let scratch = &self.scratch;
        for &slot in slots.iter() {
            kinds.push(
                scratch.kind[slot as usize]
                    .ok_or_else(|| broken!("scheduled slot {slot} without kind"))?,
            );
        }
        num_scheduled_tokens.extend(slots.iter().map(|&s| scratch.scheduled[s as usize] as i32));
        num_computed_tokens.extend(
            slots
                .iter()
                .map(|&s| scratch.computed_before[s as usize] as i32),
        );
        num_spec_tokens.extend(slots.iter().map(|&s| scratch.num_spec[s as usize]));
        query_start_loc.push(0);
        let mut total = 0i32;
        query_start_loc.extend(num_scheduled_tokens.iter().map(|&t| {
            total += t;
            total
        }));
        let mut entries = Vec::with_capacity(n);
        for &slot in slots.iter() {
            let s = slot as usize;
            let num_new = self.scratch.scheduled[s] as usize;
            let num_spec = self.scratch.num_spec[s] as usize;
            let generation = self.store.generation(slot);
            let r = self.store.get_mut(slot)?;
            r.num_computed_tokens += num_new;
            r.num_in_flight_tokens += num_new;
            let was_prefill_chunk = r.is_prefill_chunk;
            r.is_prefill_chunk = r.num_computed_tokens < r.num_tokens() + r.num_output_placeholders;
            num_output_placeholders.push(r.num_output_placeholders as u32);
            is_prefill_chunk.push(r.is_prefill_chunk);
            let new_blocks = &r.blocks.block_ids[self.scratch.new_blocks_start[s] as usize..];
            new_block_ids.extend_from_slice(new_blocks);
            num_new_blocks.push(new_blocks.len() as u32);
            generations.push(generation);
            let spec = r
                .spec_token_ids
                .get(..num_spec)
                .ok_or_else(|| broken!("scheduled drafts of slot {slot} went missing"))?;
            spec_token_ids.extend_from_slice(spec);
            r.spec_token_ids.clear();
            entries.push(InFlightEntry {
                slot,
                generation,
                rank: self.scratch.rank[s],
                num_spec_tokens: num_spec as u32,
                is_prefill_chunk: r.is_prefill_chunk,
                num_scheduled: num_new as u32,
                preemptions: r.num_preemptions,
                drop_output: false,
                was_prefill_chunk,
                admitted: self.scratch.kind[s] != Some(EntryKind::Running),
                cached_before: self.scratch.cached_before[s],
            });
            if self.config.async_scheduling && !r.is_prefill_chunk {
                add_output_placeholders(r, num_spec, self.config.num_speculative_tokens);
            }
        }
        for &slot in slots.iter() {
            self.scratch.scheduled[slot as usize] = 0;
            self.scratch.kind[slot as usize] = None;
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
