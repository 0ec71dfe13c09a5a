//! The Python parts of one `SchedulerOutput`: `num_scheduled_tokens`, the spec dict and
//! `CachedRequestData`, built in one pass over the batch.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet};

use dflash_core::prefetch;

use super::bridge_state::BridgeState;
use super::runner_reads::vllm_token;
use super::PyVllmBridge;
use crate::errors::IntoPyResult;
use crate::outputs::PySchedulerOutput;
use crate::refcount;
use crate::scheduler_state::State;
use crate::seq_items::ListBuilder;
use crate::untracked;

/// How many requests ahead the per-request loops prefetch the Python objects and records they
/// read (the core's distance).
const PREFETCH_DISTANCE: usize = prefetch::DISTANCE;

/// The Python objects of one `SchedulerOutput`, before the dataclass is built.
pub(super) struct StepParts<'py> {
    pub(super) cached: Bound<'py, PyAny>,
    pub(super) num_scheduled: Bound<'py, PyDict>,
    pub(super) spec: Bound<'py, PyDict>,
}

impl PyVllmBridge {
    pub(super) fn build_parts<'py>(
        &self,
        py: Python<'py>,
        bridge: &mut BridgeState,
        st: &mut State,
        step: &Bound<'py, PySchedulerOutput>,
    ) -> PyResult<StepParts<'py>> {
        let out = step.get();
        st.check_owner(py, out)?;
        let parts = &out.parts;
        let req_ids = out.req_ids.bind(py);
        let n = parts.slots.len();
        let previous = bridge.step_number;
        bridge.step_number += 1;
        let this_step = bridge.step_number;
        if let Some(&max_slot) = parts.slots.iter().map(|(s, _)| s).max() {
            if bridge.last_scheduled.len() <= max_slot as usize {
                bridge
                    .last_scheduled
                    .resize(max_slot as usize + 1, (u32::MAX, 0));
            }
        }

        let num_scheduled =
            bridge.num_scheduled_tokens(py, &parts.slots, &parts.num_scheduled, req_ids)?;
        // When every request has drafts (a decode step), the spec dict starts as a copy of
        // `num_scheduled_tokens` (the same keys, in the same order) whose values are then
        // replaced: no insertion, no growth.
        let all_drafted = n > 0 && parts.spec_counts[..n].iter().all(|&c| c > 0);
        let spec = if all_drafted {
            num_scheduled.copy()?
        } else {
            PyDict::new(py)
        };
        // The batch's ids: the tuple's items, borrowed (a tuple never changes, and the step
        // holds it).
        let ids: Vec<Borrowed<'_, 'py, PyAny>> = req_ids.iter_borrowed().collect();
        let mut spec_start = 0usize;
        for (i, rid) in ids.iter().enumerate().take(n) {
            // An engine's forward has evicted the ids and the draft lists this loop reads
            // (their hash, their length): ask for those of a request a few ahead.
            if let Some(ahead) = ids.get(i + PREFETCH_DISTANCE) {
                prefetch::read(ahead.as_ptr());
                bridge.prefetch_drafts(parts.slots[i + PREFETCH_DISTANCE].0);
            }
            let num_spec = parts.spec_counts[i] as usize;
            if num_spec == 0 {
                continue;
            }
            let drafts = &parts.spec_tokens[spec_start..spec_start + num_spec];
            spec_start += num_spec;
            let (slot, generation) = parts.slots[i];
            let reused = if self.async_scheduling || parts.kinds[i] != 0 {
                None
            } else {
                bridge.reusable_drafts(py, slot, generation, num_spec)?
            };
            let value = match reused {
                Some(list) => list,
                None => PyList::new(py, drafts.iter().map(|&t| vllm_token(t)))?,
            };
            spec.set_item(*rid, &value)?;
            // SAFETY: `value`'s own reference (the dict took one of its own), released once.
            unsafe { refcount::decref(value.into_ptr()) };
        }
        // Its values are lists of ints (the runner's own draft lists, or new ones): it holds
        // nothing that leads back to it.
        untracked::seal(&spec);
        // The cached requests (running, and resumed ones for V1), in batch order. When that is
        // the whole batch (a decode step), their ids are the batch's tuple as a list.
        let cached: Vec<usize> = (0..n)
            .filter(|&i| parts.kinds[i] == 0 || (parts.kinds[i] == 2 && !self.v2))
            .collect();
        let m = cached.len();
        // The lists of ints and strs below are handed out untracked by the cyclic collector
        // (`untracked`): several hundred a step, which every collection would walk again.
        let cached_ids = if m == n {
            let ids = req_ids.to_list();
            untracked::seal(&ids);
            ids
        } else {
            let mut list = ListBuilder::new(py, m)?;
            for &i in &cached {
                list.push(ids[i].to_owned());
            }
            list.finish()
        };
        let resumed = PySet::empty(py)?;
        let all_token_ids = PyDict::new(py);
        let mut block_starts = Vec::with_capacity(n + 1);
        let mut start = 0u32;
        for &c in &parts.new_block_counts {
            block_starts.push(start);
            start += c;
        }
        let ints = &mut bridge.ints;
        ints.reserve_for(st.inner.config().max_model_len);
        let (mut new_block_ids, mut num_computed, mut num_output) = (
            ListBuilder::new(py, m)?,
            ListBuilder::new(py, m)?,
            ListBuilder::new(py, m)?,
        );
        let requests = st.inner.requests();
        for (c, &i) in cached.iter().enumerate() {
            // The record and the cached counts of a request a few ahead (evicted by a forward).
            if let Some(&ahead) = cached.get(c + PREFETCH_DISTANCE) {
                requests.prefetch_record(parts.slots[ahead].0);
                ints.prefetch(parts.num_computed[ahead] as usize);
            }
            let (slot, generation) = parts.slots[i];
            let request = requests.get(slot).py(py)?;
            let mut outputs = request.num_output_tokens();
            if self.async_scheduling {
                outputs += parts.num_output_placeholders[i] as usize;
            }
            num_output.push(ints.get(py, outputs as i64)?);
            num_computed.push(ints.get(py, i64::from(parts.num_computed[i]))?);
            let start = block_starts[i] as usize;
            let blocks = &parts.new_blocks[start..start + parts.new_block_counts[i] as usize];
            new_block_ids.push(if blocks.is_empty() && parts.kinds[i] == 0 {
                refcount::none(py)
            } else {
                untracked::tuple1(untracked::list(py, blocks)?)?.into_any()
            });
            let was_previous = bridge.last_scheduled[slot as usize] == (generation, previous);
            if parts.kinds[i] == 2 {
                resumed.add(ids[i])?;
            }
            if !self.v2 && !was_previous {
                let tokens = untracked::list(py, &request.tokens)?;
                all_token_ids.set_item(ids[i], tokens)?;
            }
        }
        let (new_block_ids, num_computed, num_output) = (
            new_block_ids.finish(),
            num_computed.finish(),
            num_output.finish(),
        );
        for &(slot, generation) in &parts.slots {
            bridge.last_scheduled[slot as usize] = (generation, this_step);
        }
        bridge.last_step = Some(step.clone().unbind());
        let cached = self.types.cached_request_data.build(
            py,
            [
                cached_ids.into_any(),
                resumed.into_any(),
                PyList::empty(py).into_any(),
                all_token_ids.into_any(),
                new_block_ids.into_any(),
                num_computed.into_any(),
                num_output.into_any(),
            ],
        )?;
        Ok(StepParts {
            cached,
            num_scheduled,
            spec,
        })
    }
}
