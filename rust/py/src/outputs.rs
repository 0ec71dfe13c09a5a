//! Python views of one step: `SchedulerOutput` (with zero-copy block-table arrays and lazily
//! built dicts) and the `OutputArg` that takes one back, `NewRequestData`,
//! `CachedRequestData`, `RequestOutput` and `UpdateResult`.

use std::ops::Deref;
use std::sync::Arc;

use dflash_core::{FinishReason, TableSnapshot};
use numpy::ndarray::{ArrayView1, ArrayView2};
use numpy::{PyArray1, PyArray2, PyUntypedArrayMethods};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyFrozenSet, PyList, PySet, PyString, PyTuple};
use pyo3::PyTraverseError;

use crate::errors::{type_name, wrong_type};
use crate::lazy_table::LazyTable;
use crate::scheduler_state::PyScheduler;

/// `array`, made read-only as `setflags(write=False)` makes it, without a Python call.
pub fn read_only<'py, A>(array: Bound<'py, A>) -> Bound<'py, A>
where
    Bound<'py, A>: PyUntypedArrayMethods<'py>,
{
    // SAFETY: `array` is a live numpy array; clearing WRITEABLE (numpy's PyArray_CLEARFLAGS)
    // only restricts what Python may do with it.
    unsafe {
        (*array.as_array_ptr()).fields.flags &= !numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
    }
    array
}

/// A request scheduled for the first time (or resumed), with everything the runner needs.
/// Token and block lists are built from Rust buffers, a new list at every access.
#[pyclass(module = "dflash_rs._core", name = "NewRequestData", frozen)]
pub struct PyNewRequestData {
    /// Request id.
    #[pyo3(get)]
    pub req_id: Py<PyString>,
    /// Tokens already computed (prefix-cache hits).
    #[pyo3(get)]
    pub num_computed_tokens: usize,
    /// True when the request was preempted before and recomputes prompt + outputs.
    #[pyo3(get)]
    pub resumed: bool,
    /// Prompt + output tokens; the prompt is the first `num_prompt_tokens`.
    pub all_tokens: Vec<u32>,
    /// Prompt length.
    pub num_prompt_tokens: usize,
    /// Every block the request holds (prefix hits first).
    pub blocks: Vec<u32>,
}

impl PyNewRequestData {
    /// A new-request record; the Python lists are built lazily.
    pub fn new(
        req_id: Py<PyString>,
        num_computed_tokens: usize,
        resumed: bool,
        all_tokens: Vec<u32>,
        num_prompt_tokens: usize,
        blocks: Vec<u32>,
    ) -> Self {
        Self {
            req_id,
            num_computed_tokens,
            resumed,
            all_tokens,
            num_prompt_tokens,
            blocks,
        }
    }
}

#[pymethods]
impl PyNewRequestData {
    /// Prompt token ids.
    #[getter]
    fn prompt_token_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, &self.all_tokens[..self.num_prompt_tokens])?.unbind())
    }

    /// Every block the request holds (prefix hits first).
    #[getter]
    fn block_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, &self.blocks)?.unbind())
    }

    /// Prompt + output tokens (what a resumed request recomputes).
    #[getter]
    fn all_token_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, &self.all_tokens)?.unbind())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "NewRequestData(req_id={}, num_computed_tokens={}, block_ids={:?}, resumed={})",
            self.req_id.bind(py),
            self.num_computed_tokens,
            self.blocks,
            self.resumed
        )
    }
}

/// Requests that were running before this step (vLLM's `CachedRequestData`), plus resumed ones.
#[pyclass(
    module = "dflash_rs._core",
    name = "CachedRequestData",
    frozen,
    get_all
)]
pub struct PyCachedRequestData {
    /// Ids, in batch order.
    pub req_ids: Py<PyList>,
    /// Ids of requests readmitted after preemption (their `new_block_ids` replace the table).
    pub resumed_req_ids: Py<PySet>,
    /// Per request: blocks allocated this step, or None.
    pub new_block_ids: Py<PyList>,
    /// Per request: computed tokens before this step.
    pub num_computed_tokens: Py<PyList>,
}

/// Batch-ordered data the lazy properties are built from.
pub struct LazyParts {
    /// Tokens scheduled per entry.
    pub num_scheduled: Vec<i32>,
    /// Entry kinds: 0 running, 1 new, 2 resumed.
    pub kinds: Vec<u8>,
    /// Draft tokens scheduled, flat, and per-entry counts.
    pub spec_tokens: Vec<u32>,
    /// Per-entry draft counts.
    pub spec_counts: Vec<u32>,
    /// Blocks allocated this step for running entries, flat, and per-entry counts.
    pub new_blocks: Vec<u32>,
    /// Per-entry new block counts.
    pub new_block_counts: Vec<u32>,
    /// Computed tokens before the step, per entry.
    pub num_computed: Vec<i32>,
    /// (slot, generation) of each entry: identifies the request without an id lookup.
    pub slots: Vec<(u32, u32)>,
    /// Output placeholders before the step, per entry (async scheduling).
    pub num_output_placeholders: Vec<u32>,
    /// The scheduler that produced the step.
    pub scheduler_uid: u64,
}

/// One step's schedule. Arrays are in batch order: entry `i` is `req_ids[i]` and row `i` of
/// `block_table`.
///
/// An output reads the same for as long as anyone holds it, whatever the scheduler does
/// meanwhile: arrays are read-only, `req_ids` is a tuple (shared by consecutive steps with the
/// same batch), id sets are frozensets, `scheduled_new_reqs` is a tuple, and the dict- and
/// list-valued properties build a new object at every access. `block_table` and
/// `num_blocks_per_row` view a snapshot of the table as it was when the step was returned,
/// made when one of them is first read (so a step nobody reads costs no copy) and never
/// written to while it is held.
#[pyclass(module = "dflash_rs._core", name = "SchedulerOutput", frozen)]
pub struct PySchedulerOutput {
    #[pyo3(get)]
    pub step_id: u64,
    #[pyo3(get)]
    pub req_ids: Py<PyTuple>,
    #[pyo3(get)]
    pub total_num_scheduled_tokens: usize,
    #[pyo3(get)]
    pub num_scheduled_tokens_array: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub num_computed_tokens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    pub is_prefill_chunk: Py<PyArray1<bool>>,
    #[pyo3(get)]
    pub finished_req_ids: Py<PyFrozenSet>,
    #[pyo3(get)]
    pub preempted_req_ids: Py<PyFrozenSet>,
    #[pyo3(get)]
    pub scheduled_new_reqs: Py<PyTuple>,
    #[pyo3(get)]
    pub num_lookahead_tokens: usize,
    pub parts: LazyParts,
    /// The step's block table, frozen at first read.
    pub table: StepTable,
}

/// A step's block table: the table version it was returned at, the scheduler to freeze it
/// from, and its arrays once read.
pub struct StepTable {
    /// Rows of the step.
    rows: usize,
    /// Version and frozen copy, shared with the scheduler (which freezes unread tables itself
    /// before it forgets the changes they need).
    lazy: Arc<LazyTable>,
    /// The scheduler that produced the step.
    scheduler: Py<PyScheduler>,
    arrays: PyOnceLock<TableArrays>,
}

/// `(block_table, num_blocks_per_row)` of a step.
type TableArrays = (Py<PyArray2<i32>>, Py<PyArray1<i32>>);

/// Keeps a step's block-table snapshot alive: the base object of its numpy arrays.
#[pyclass(module = "dflash_rs._core", name = "_BlockTableSnapshot", frozen)]
struct TableLease(#[allow(dead_code)] Arc<TableSnapshot>);

impl StepTable {
    /// The table of a step of `rows` entries returned at `version`.
    pub(crate) fn new(rows: usize, lazy: Arc<LazyTable>, scheduler: Py<PyScheduler>) -> Self {
        Self {
            rows,
            lazy,
            scheduler,
            arrays: PyOnceLock::new(),
        }
    }

    /// `(block_table, num_blocks_per_row)`, frozen now if not yet.
    fn arrays(&self, py: Python<'_>) -> PyResult<&TableArrays> {
        self.arrays.get_or_try_init(py, || {
            let snapshot = match self.lazy.snapshot.get() {
                Some(s) => s.clone(),
                None => self.scheduler.get().freeze_table(py, &self.lazy)?,
            };
            let n = self.rows;
            let width = snapshot.width();
            let (table, counts) = (snapshot.as_slice().as_ptr(), snapshot.counts().as_ptr());
            let lease = Bound::new(py, TableLease(snapshot))?.into_any();
            // SAFETY: the buffers belong to the snapshot that `lease` (the arrays' base object)
            // keeps alive, and nothing writes to a snapshot while it is shared (`SnapshotPool`
            // only syncs snapshots it owns alone), so the arrays read the step's table for as
            // long as anyone holds them.
            let block_table = unsafe {
                PyArray2::borrow_from_array(
                    &ArrayView2::from_shape_ptr((n, width), table),
                    lease.clone(),
                )
            };
            let counts = unsafe {
                PyArray1::borrow_from_array(&ArrayView1::from_shape_ptr(n, counts), lease)
            };
            // The base is no writable buffer, so read-only arrays cannot be made writable again.
            Ok((read_only(block_table).unbind(), read_only(counts).unbind()))
        })
    }
}

impl PySchedulerOutput {
    /// Assembles an output; the lazy members start empty.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        step_id: u64,
        req_ids: Py<PyTuple>,
        total_num_scheduled_tokens: usize,
        num_scheduled_tokens_array: Py<PyArray1<i32>>,
        num_computed_tokens: Py<PyArray1<i32>>,
        query_start_loc: Py<PyArray1<i32>>,
        is_prefill_chunk: Py<PyArray1<bool>>,
        finished_req_ids: Py<PyFrozenSet>,
        preempted_req_ids: Py<PyFrozenSet>,
        scheduled_new_reqs: Py<PyTuple>,
        num_lookahead_tokens: usize,
        parts: LazyParts,
        table: StepTable,
    ) -> Self {
        Self {
            step_id,
            req_ids,
            total_num_scheduled_tokens,
            num_scheduled_tokens_array,
            num_computed_tokens,
            query_start_loc,
            is_prefill_chunk,
            finished_req_ids,
            preempted_req_ids,
            scheduled_new_reqs,
            num_lookahead_tokens,
            parts,
            table,
        }
    }
}

#[pymethods]
impl PySchedulerOutput {
    /// int32 `[num_reqs, width]`: row `i` holds `req_ids[i]`'s blocks as the step was returned,
    /// zeros past its count (read-only; frozen at first read).
    #[getter]
    fn block_table(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        Ok(self.table.arrays(py)?.0.clone_ref(py))
    }

    /// int32 `[num_reqs]`: the used entries of each `block_table` row (read-only).
    #[getter]
    fn num_blocks_per_row(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i32>>> {
        Ok(self.table.arrays(py)?.1.clone_ref(py))
    }

    /// Garbage-collector support: the scheduler the output refers to (a cycle through it, e.g.
    /// a config holding outputs, is then collected).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.table.scheduler)
    }

    /// Number of scheduled requests.
    #[getter]
    fn num_reqs(&self, py: Python<'_>) -> usize {
        self.req_ids.bind(py).len()
    }

    /// Draft tokens scheduled for verification per request, in batch order.
    #[getter]
    fn num_spec_tokens_array<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        read_only(PyArray1::from_slice(py, &self.parts.spec_counts))
    }

    /// Async scheduling: output tokens still to come from earlier steps in flight, per
    /// request, before this step (vLLM's `num_output_placeholders`); zeros otherwise.
    #[getter]
    fn num_output_placeholders<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        read_only(PyArray1::from_slice(
            py,
            &self.parts.num_output_placeholders,
        ))
    }

    /// `{req_id: tokens scheduled}` (a new dict at every access).
    #[getter]
    fn num_scheduled_tokens(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        for (id, n) in self.req_ids.bind(py).iter().zip(&self.parts.num_scheduled) {
            d.set_item(id, *n)?;
        }
        Ok(d.unbind())
    }

    /// `{req_id: draft tokens to verify}` for requests with drafts (a new dict at every
    /// access); a placeholder draft of a padded admission is `-1`, as in vLLM.
    #[getter]
    fn scheduled_spec_decode_tokens(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let d = PyDict::new(py);
        let mut start = 0usize;
        for (id, &n) in self.req_ids.bind(py).iter().zip(&self.parts.spec_counts) {
            let end = start + n as usize;
            if n > 0 {
                let tokens = self.parts.spec_tokens[start..end].iter().map(|&t| {
                    if t == dflash_core::PLACEHOLDER_TOKEN {
                        -1
                    } else {
                        i64::from(t)
                    }
                });
                d.set_item(id, PyList::new(py, tokens)?)?;
            }
            start = end;
        }
        Ok(d.unbind())
    }

    /// Running and resumed requests with their new blocks (a new object at every access).
    #[getter]
    fn scheduled_cached_reqs(&self, py: Python<'_>) -> PyResult<Py<PyCachedRequestData>> {
        let req_ids = PyList::empty(py);
        let resumed = PySet::empty(py)?;
        let new_block_ids = PyList::empty(py);
        let num_computed = PyList::empty(py);
        let mut start = 0usize;
        for (i, id) in self.req_ids.bind(py).iter().enumerate() {
            let count = self.parts.new_block_counts[i] as usize;
            let blocks = &self.parts.new_blocks[start..start + count];
            start += count;
            match self.parts.kinds[i] {
                0 => {
                    req_ids.append(&id)?;
                    if count == 0 {
                        new_block_ids.append(py.None())?;
                    } else {
                        new_block_ids.append(PyList::new(py, blocks)?)?;
                    }
                    num_computed.append(self.parts.num_computed[i])?;
                }
                2 => {
                    req_ids.append(&id)?;
                    resumed.add(&id)?;
                    new_block_ids.append(PyList::new(py, blocks)?)?;
                    num_computed.append(self.parts.num_computed[i])?;
                }
                _ => {}
            }
        }
        Py::new(
            py,
            PyCachedRequestData {
                req_ids: req_ids.unbind(),
                resumed_req_ids: resumed.unbind(),
                new_block_ids: new_block_ids.unbind(),
                num_computed_tokens: num_computed.unbind(),
            },
        )
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.req_ids.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "SchedulerOutput(step_id={}, num_reqs={}, total_num_scheduled_tokens={}, new={}, \
             finished={}, preempted={})",
            self.step_id,
            self.req_ids.bind(py).len(),
            self.total_num_scheduled_tokens,
            self.scheduled_new_reqs.bind(py).len(),
            self.finished_req_ids.bind(py).len(),
            self.preempted_req_ids.bind(py).len()
        )
    }
}

/// A `SchedulerOutput` argument.
pub(crate) struct OutputArg<'a, 'py>(Borrowed<'a, 'py, PySchedulerOutput>);

impl<'a, 'py> FromPyObject<'a, 'py> for OutputArg<'a, 'py> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        match obj.cast::<PySchedulerOutput>() {
            Ok(output) => Ok(OutputArg(output)),
            Err(_) => Err(wrong_type(
                obj.py(),
                format!(
                    "output must be a SchedulerOutput (from schedule()), got {}",
                    type_name(&obj)
                ),
            )),
        }
    }
}

impl<'py> Deref for OutputArg<'_, 'py> {
    type Target = Bound<'py, PySchedulerOutput>;

    fn deref(&self) -> &Bound<'py, PySchedulerOutput> {
        &self.0
    }
}

/// What one request got from one `update_from_output`.
///
/// One is built per request per step, so it costs one Python allocation and nothing more: the
/// tokens live in the object itself (see [`OutputTokens`]), and freed objects are kept for
/// reuse (`freelist`: a steady batch of that many requests allocates no memory for them). The
/// other attributes are Python objects read in place (struct members, no getter call).
#[pyclass(
    module = "dflash_rs._core",
    name = "RequestOutput",
    frozen,
    freelist = 4096
)]
pub struct PyRequestOutput {
    #[pyo3(get)]
    request_id: Py<PyString>,
    new_tokens: OutputTokens,
    /// "stop", "length", "abort", "error" (one str each per process), or None while running.
    #[pyo3(get)]
    finish_reason: Py<PyAny>,
    /// The stop token that ended the request, or None.
    #[pyo3(get)]
    stop_reason: Py<PyAny>,
}

/// A `RequestOutput`'s tokens: inline up to [`OutputTokens::INLINE`] (K + 1 tokens for any
/// K up to 14), on the heap beyond. Each output owns its tokens, so one held output keeps no
/// other request's tokens alive.
enum OutputTokens {
    Inline {
        len: u8,
        tokens: [u32; OutputTokens::INLINE],
    },
    Heap(Box<[u32]>),
}

impl OutputTokens {
    const INLINE: usize = 15;

    fn new(tokens: &[u32]) -> Self {
        if tokens.len() <= Self::INLINE {
            let mut inline = [0; Self::INLINE];
            inline[..tokens.len()].copy_from_slice(tokens);
            Self::Inline {
                len: tokens.len() as u8,
                tokens: inline,
            }
        } else {
            Self::Heap(tokens.into())
        }
    }

    fn as_slice(&self) -> &[u32] {
        match self {
            Self::Inline { len, tokens } => &tokens[..*len as usize],
            Self::Heap(tokens) => tokens,
        }
    }
}

impl PyRequestOutput {
    /// The output of a request that received `new_tokens` (its finish reason and stop token
    /// once it finished).
    pub fn new(
        py: Python<'_>,
        request_id: Py<PyString>,
        new_tokens: &[u32],
        finish_reason: Option<FinishReason>,
        stop_reason: Option<u32>,
    ) -> PyResult<Self> {
        Ok(Self {
            request_id,
            new_tokens: OutputTokens::new(new_tokens),
            finish_reason: match finish_reason {
                Some(reason) => finish_reason_str(py, reason).clone().into_any().unbind(),
                None => py.None(),
            },
            stop_reason: stop_reason.into_pyobject(py)?.unbind(),
        })
    }

    /// The final output of a request the scheduler ended on its own: no tokens, its reason.
    pub fn ended(py: Python<'_>, ended: &dflash_core::EndedRequest) -> PyResult<Self> {
        let id = PyString::new(py, &ended.request_id).unbind();
        Self::new(py, id, &[], Some(ended.finish_reason), None)
    }
}

/// A finish reason's name, one str per process.
fn finish_reason_str(py: Python<'_>, reason: FinishReason) -> &Bound<'_, PyString> {
    match reason {
        FinishReason::Stop => intern!(py, "stop"),
        FinishReason::Length => intern!(py, "length"),
        FinishReason::Abort => intern!(py, "abort"),
        FinishReason::Error => intern!(py, "error"),
    }
}

#[pymethods]
impl PyRequestOutput {
    /// Tokens accepted in this step (accepted drafts + bonus, cut at a stop).
    #[getter]
    fn new_token_ids(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        Ok(PyList::new(py, self.new_tokens.as_slice())?.unbind())
    }

    /// Whether the request finished in this step.
    #[getter]
    fn finished(&self, py: Python<'_>) -> bool {
        !self.finish_reason.is_none(py)
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "RequestOutput(request_id={}, new_token_ids={:?}, finish_reason={})",
            self.request_id.bind(py),
            self.new_tokens.as_slice(),
            self.finish_reason
                .bind(py)
                .repr()
                .map_or("?".into(), |r| r.to_string())
        )
    }
}

/// The result of `update_from_output_arrays`: the same update as `update_from_output`, as flat
/// arrays. Entry `j` is the `j`-th request that received tokens, in batch order. Requests the
/// scheduler ended on its own since the previous update have no entry; they close the
/// finished lists.
#[pyclass(module = "dflash_rs._core", name = "UpdateResult", frozen)]
pub struct PyUpdateResult {
    /// int32 `[m]`: index of each entry's request in the step's `req_ids`.
    #[pyo3(get)]
    batch_index: Py<PyArray1<i32>>,
    /// int32 `[m]`: tokens each entry accepted (accepted drafts + bonus, cut at a stop).
    #[pyo3(get)]
    num_new_tokens: Py<PyArray1<i32>>,
    /// int32 `[sum(num_new_tokens)]`: the accepted tokens, entry after entry.
    #[pyo3(get)]
    new_token_ids: Py<PyArray1<i32>>,
    /// Ids of the requests that finished in this update: entries in batch order, then the
    /// requests the scheduler ended on its own (no entry, reason "error").
    #[pyo3(get)]
    finished_req_ids: Py<PyList>,
    /// Their finish reasons ("stop", "length", "abort", "error").
    #[pyo3(get)]
    finish_reasons: Py<PyList>,
    /// Their stop tokens (None unless a stop token ended the request).
    #[pyo3(get)]
    stop_reasons: Py<PyList>,
}

impl PyUpdateResult {
    /// From the core's update; `slots` is the step's batch order, `id_of` names a slot.
    pub fn build(
        py: Python<'_>,
        update: &dflash_core::UpdateOutput,
        slots: &[(u32, u32)],
        id_of: impl Fn(u32) -> PyResult<Py<PyString>>,
    ) -> PyResult<Self> {
        let m = update.updates.len();
        let (mut index, mut counts) = (Vec::with_capacity(m), Vec::with_capacity(m));
        let finished = PyList::empty(py);
        let reasons = PyList::empty(py);
        let stops = PyList::empty(py);
        let mut cursor = 0usize;
        for u in &update.updates {
            // Updates come in batch order, a subsequence of the step's slots.
            while cursor < slots.len() && slots[cursor].0 != u.slot {
                cursor += 1;
            }
            if cursor == slots.len() {
                return Err(crate::errors::to_py(
                    py,
                    dflash_core::CoreError::Invariant(format!(
                        "updated slot {} is not in the step's batch",
                        u.slot
                    )),
                ));
            }
            index.push(cursor as i32);
            counts.push((u.tokens_end - u.tokens_start) as i32);
            if let Some(reason) = u.finish_reason {
                finished.append(id_of(u.slot)?)?;
                reasons.append(reason.name())?;
                stops.append(u.stop_token)?;
            }
            cursor += 1;
        }
        for e in &update.ended {
            finished.append(&e.request_id)?;
            reasons.append(e.finish_reason.name())?;
            stops.append(None::<u32>)?;
        }
        let tokens: Vec<i32> = update.new_token_ids.iter().map(|&t| t as i32).collect();
        Ok(Self {
            batch_index: PyArray1::from_vec(py, index).unbind(),
            num_new_tokens: PyArray1::from_vec(py, counts).unbind(),
            new_token_ids: PyArray1::from_vec(py, tokens).unbind(),
            finished_req_ids: finished.unbind(),
            finish_reasons: reasons.unbind(),
            stop_reasons: stops.unbind(),
        })
    }
}

#[pymethods]
impl PyUpdateResult {
    fn __len__(&self, py: Python<'_>) -> usize {
        self.batch_index.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "UpdateResult(entries={}, tokens={}, finished={})",
            self.batch_index.bind(py).len(),
            self.new_token_ids.bind(py).len(),
            self.finished_req_ids.bind(py).len()
        )
    }
}
