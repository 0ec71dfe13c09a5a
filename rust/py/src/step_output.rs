//! Assembling the `SchedulerOutput` a step hands out from the core's step: the shared
//! `req_ids` tuple, read-only arrays, the new requests' records, the batch-ordered parts the
//! lazy properties read, and the step's lazily frozen block table.

use dflash_core::EntryKind;
use numpy::PyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyFrozenSet, PyTuple};

use crate::errors::IntoPyResult;
use crate::outputs::{read_only, LazyParts, PyNewRequestData, PySchedulerOutput, StepTable};
use crate::scheduler_state::{PyScheduler, State};

impl State {
    /// The output of the step just planned into `self.step`, for the scheduler `slf`.
    pub(crate) fn build_output(
        &mut self,
        slf: &Bound<'_, PyScheduler>,
    ) -> PyResult<PySchedulerOutput> {
        let py = slf.py();
        self.tables.maintain_journal(py, &mut self.inner)?;
        let req_ids = self.ids.req_ids_tuple(py, &self.step.slots)?;
        let lazy = self.tables.hand_out(&self.inner);
        let this = &*self;
        let step = &this.step;
        let n = step.num_reqs();
        let table = StepTable::new(n, lazy, slf.clone().unbind());
        let mut new_reqs = Vec::new();
        let mut kinds = Vec::with_capacity(n);
        for (i, kind) in step.kinds.iter().enumerate() {
            kinds.push(match kind {
                EntryKind::Running => 0u8,
                EntryKind::New => 1,
                EntryKind::Resumed => 2,
            });
            if *kind != EntryKind::Running {
                let r = this.inner.requests().get(step.slots[i]).py(py)?;
                let data = PyNewRequestData::new(
                    this.ids.id_of(py, step.slots[i])?,
                    step.num_computed_tokens[i] as usize,
                    *kind == EntryKind::Resumed,
                    r.tokens.clone(),
                    r.num_prompt_tokens(),
                    r.blocks.block_ids.clone(),
                );
                new_reqs.push(Py::new(py, data)?);
            }
        }
        let finished = PyFrozenSet::new(py, &step.finished_req_ids)?;
        let preempted = PyFrozenSet::new(py, &step.preempted_req_ids)?;
        let arrays = (
            read_only(PyArray1::from_slice(py, &step.num_scheduled_tokens)).unbind(),
            read_only(PyArray1::from_slice(py, &step.num_computed_tokens)).unbind(),
            read_only(PyArray1::from_slice(py, &step.query_start_loc)).unbind(),
            read_only(PyArray1::from_slice(py, &step.is_prefill_chunk)).unbind(),
        );
        let slots = step
            .slots
            .iter()
            .copied()
            .zip(step.generations.iter().copied())
            .collect();
        let (step_id, total, lookahead, uid) = (
            step.step_id,
            step.total_num_scheduled_tokens,
            step.num_lookahead_tokens,
            step.scheduler_uid,
        );
        // The step's columns move into the output (the next step fills new vectors of the
        // same capacity): no copy of a step's tokens and blocks.
        let step = &mut self.step;
        let parts = LazyParts {
            num_scheduled: take_keeping_capacity(&mut step.num_scheduled_tokens),
            kinds,
            spec_tokens: take_keeping_capacity(&mut step.spec_token_ids),
            spec_counts: take_keeping_capacity(&mut step.num_spec_tokens),
            new_blocks: take_keeping_capacity(&mut step.new_block_ids),
            new_block_counts: take_keeping_capacity(&mut step.num_new_blocks),
            num_computed: take_keeping_capacity(&mut step.num_computed_tokens),
            slots,
            num_output_placeholders: take_keeping_capacity(&mut step.num_output_placeholders),
            scheduler_uid: uid,
        };
        Ok(PySchedulerOutput::new(
            step_id,
            req_ids.unbind(),
            total,
            arrays.0,
            arrays.1,
            arrays.2,
            arrays.3,
            finished.unbind(),
            preempted.unbind(),
            PyTuple::new(py, new_reqs)?.unbind(),
            lookahead,
            parts,
            table,
        ))
    }
}

/// `v`'s contents, leaving it empty with the same capacity.
fn take_keeping_capacity<T>(v: &mut Vec<T>) -> Vec<T> {
    let capacity = v.capacity();
    std::mem::replace(v, Vec::with_capacity(capacity))
}
