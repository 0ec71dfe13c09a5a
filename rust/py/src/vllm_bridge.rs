//! `_VllmBridge`: the vLLM drop-in's per-step objects, built here in one pass instead of one
//! Python call per request. It builds vLLM's `SchedulerOutput` (its `CachedRequestData` and the
//! per-request dicts), applies `ModelRunnerOutput.sampled_token_ids` and builds one
//! `EngineCoreOutput` per request that got tokens, and reads `DraftTokenIds`. The vLLM classes
//! are resolved once, by the adapter (`dflash_rs.vllm`), so the objects are exactly vLLM's.
//!
//! What the adapter still does in Python is what is rare: admissions (`NewRequestData` needs the
//! vLLM `Request`), preemptions, and outputs that carry more than tokens (events, prefill
//! stats, logprobs, a finish), which come back as "slow" entries for it to fill in.

use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString, PyTuple, PyType};
use pyo3::PyTraverseError;

use dflash_core::prefetch;
use dflash_core::PLACEHOLDER_TOKEN;

use crate::convert::{push_exact_token_ids, token_ids};
use crate::dataclass_build::DataclassBuilder;
use crate::errors::{invalid, unless_fatal, IntoPyResult};
use crate::guarded::Guarded;
use crate::outputs::PySchedulerOutput;
use crate::refcount::{self, Owned};
use crate::scheduler_state::{PyScheduler, State};
use crate::seq_items::{with_exact_items, ListBuilder};
use crate::struct_slots::StructBuilder;
use crate::untracked;

/// How many requests ahead the per-request loops prefetch the Python objects and records they
/// read (the core's distance).
const PREFETCH_DISTANCE: usize = prefetch::DISTANCE;

/// The vLLM classes the bridge instantiates.
struct VllmTypes {
    scheduler_output: DataclassFields<10>,
    cached_request_data: DataclassFields<7>,
    engine_core_output: EngineCoreOutputType,
    stats: StatsTypes,
    /// vLLM's `FinishReason` per core reason, in `FinishReason`'s order (stop, length, abort,
    /// error).
    finish_reasons: [Py<PyAny>; 4],
}

/// vLLM's per-step stats dataclasses (`SchedulerStats`, `PrefixCacheStats`,
/// `SpecDecodingStats`) and the indices of the fields the bridge sets.
struct StatsTypes {
    scheduler: DataclassBuilder,
    prefix: DataclassBuilder,
    spec: DataclassBuilder,
    /// `SchedulerStats`: running, waiting, skipped, usage, prefix stats, spec stats.
    scheduler_fields: [usize; 6],
    /// `PrefixCacheStats`: reset, then the six counters in `stats_counters`' order.
    prefix_fields: [usize; 7],
    /// `SpecDecodingStats`: K, drafts, draft tokens, accepted, accepted and drafted per
    /// position.
    spec_fields: [usize; 6],
}

impl StatsTypes {
    fn new(classes: &Bound<'_, PyTuple>) -> PyResult<Self> {
        let py = classes.py();
        let (scheduler, prefix, spec): (Bound<'_, PyType>, Bound<'_, PyType>, Bound<'_, PyType>) =
            classes.extract()?;
        let zero = || 0_i64.into_pyobject(py).map(|z| z.into_any());
        let prefix_names = [
            "reset",
            "requests",
            "queries",
            "hits",
            "preempted_requests",
            "preempted_queries",
            "preempted_hits",
        ];
        let prefix = DataclassBuilder::new(&prefix, &[("requests", zero()?)])?;
        let spec_names = [
            "num_spec_tokens",
            "num_drafts",
            "num_draft_tokens",
            "num_accepted_tokens",
            "num_accepted_tokens_per_pos",
            "num_draft_tokens_per_pos",
        ];
        let spec = DataclassBuilder::new(&spec, &[("num_spec_tokens", zero()?)])?;
        let scheduler_names = [
            "num_running_reqs",
            "num_waiting_reqs",
            "num_skipped_waiting_reqs",
            "kv_cache_usage",
            "prefix_cache_stats",
            "spec_decoding_stats",
        ];
        let scheduler = DataclassBuilder::new(&scheduler, &[("num_running_reqs", zero()?)])?;
        let fields = |b: &DataclassBuilder, names: &[&str]| -> PyResult<Vec<usize>> {
            names.iter().map(|n| b.field(py, n)).collect()
        };
        Ok(Self {
            scheduler_fields: fields(&scheduler, &scheduler_names)?.try_into().unwrap(),
            prefix_fields: fields(&prefix, &prefix_names)?.try_into().unwrap(),
            spec_fields: fields(&spec, &spec_names)?.try_into().unwrap(),
            scheduler,
            prefix,
            spec,
        })
    }
}

/// The fields of vLLM's `SchedulerOutput` the bridge sets, in the order it gives them.
const STEP_OUTPUT_FIELDS: [&str; 10] = [
    "scheduled_new_reqs",
    "scheduled_cached_reqs",
    "num_scheduled_tokens",
    "total_num_scheduled_tokens",
    "scheduled_spec_decode_tokens",
    "scheduled_encoder_inputs",
    "finished_req_ids",
    "free_encoder_mm_hashes",
    "preempted_req_ids",
    "num_spec_tokens_to_schedule",
];

/// The fields of vLLM's `CachedRequestData`, in the order the bridge gives them.
const CACHED_REQUEST_DATA_FIELDS: [&str; 7] = [
    "req_ids",
    "resumed_req_ids",
    "new_token_ids",
    "all_token_ids",
    "new_block_ids",
    "num_computed_tokens",
    "num_output_tokens",
];

/// A vLLM dataclass the bridge builds from the same `N` fields each time, given in the order
/// of the names it was made with.
struct DataclassFields<const N: usize> {
    builder: DataclassBuilder,
    fields: [usize; N],
}

impl<const N: usize> DataclassFields<N> {
    /// `example` holds valid values of the `names` fields (the direct build is checked on it).
    fn new(
        cls: &Bound<'_, PyType>,
        names: &[&str; N],
        example: [Bound<'_, PyAny>; N],
    ) -> PyResult<Self> {
        let py = cls.py();
        let pairs: Vec<(&str, Bound<'_, PyAny>)> = names.iter().copied().zip(example).collect();
        let builder = DataclassBuilder::new(cls, &pairs)?;
        let mut fields = [0; N];
        for (slot, name) in fields.iter_mut().zip(names) {
            *slot = builder.field(py, name)?;
        }
        Ok(Self { builder, fields })
    }

    fn build<'py>(
        &self,
        py: Python<'py>,
        values: [Bound<'py, PyAny>; N],
    ) -> PyResult<Bound<'py, PyAny>> {
        let given: Vec<(usize, &Bound<'py, PyAny>)> =
            self.fields.iter().copied().zip(values.iter()).collect();
        self.builder.build(py, &given)
    }
}

/// `SchedulerOutput` and `CachedRequestData`, checked on a valid empty step.
fn step_output_types(
    scheduler_output: &Bound<'_, PyType>,
    cached_request_data: &Bound<'_, PyType>,
) -> PyResult<(DataclassFields<10>, DataclassFields<7>)> {
    let py = scheduler_output.py();
    let list = || PyList::empty(py).into_any();
    let dict = || PyDict::new(py).into_any();
    let set = || PySet::empty(py).map(|s| s.into_any());
    let zero = || 0_i64.into_pyobject(py).map(|z| z.into_any());
    let cached = DataclassFields::new(
        cached_request_data,
        &CACHED_REQUEST_DATA_FIELDS,
        [list(), set()?, list(), dict(), list(), list(), list()],
    )?;
    let empty_cached = cached.build(py, std::array::from_fn(|_| list()))?;
    let step = DataclassFields::new(
        scheduler_output,
        &STEP_OUTPUT_FIELDS,
        [
            list(),
            empty_cached,
            dict(),
            zero()?,
            dict(),
            dict(),
            set()?,
            list(),
            set()?,
            zero()?,
        ],
    )?;
    Ok((step, cached))
}

/// vLLM's `EngineCoreOutput` (a msgspec struct) and the indices of the fields the bridge sets.
struct EngineCoreOutputType {
    builder: StructBuilder,
    request_id: usize,
    new_token_ids: usize,
    finish_reason: usize,
    stop_reason: usize,
}

impl EngineCoreOutputType {
    fn new(ty: &Bound<'_, PyAny>) -> PyResult<Self> {
        let py = ty.py();
        let builder = StructBuilder::new(ty)?;
        Ok(Self {
            request_id: builder.field(py, "request_id")?,
            new_token_ids: builder.field(py, "new_token_ids")?,
            finish_reason: builder.field(py, "finish_reason")?,
            stop_reason: builder.field(py, "stop_reason")?,
            builder,
        })
    }

    /// An output that carries new tokens only (the references are moved into it).
    fn tokens<'py>(
        &self,
        rid: Bound<'py, PyAny>,
        tokens: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.builder.build(
            rid.py(),
            [(self.request_id, rid), (self.new_token_ids, tokens)],
        )
    }

    /// A final output: new tokens, the finish reason and the stop reason.
    fn finished<'py>(
        &self,
        rid: Bound<'py, PyAny>,
        tokens: Bound<'py, PyAny>,
        reason: Bound<'py, PyAny>,
        stop: Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.builder.build(
            rid.py(),
            [
                (self.request_id, rid),
                (self.new_token_ids, tokens),
                (self.finish_reason, reason),
                (self.stop_reason, stop),
            ],
        )
    }
}

/// Per-slot memory of the bridge, keyed by the slot's generation so that a reused slot never
/// sees its previous request's entries.
#[derive(Default)]
struct BridgeState {
    /// The runner's latest draft list per slot: reused as the value of
    /// `scheduled_spec_decode_tokens` when it still holds exactly the drafts scheduled.
    drafts: Vec<Option<(u32, Py<PyList>)>>,
    /// `(generation, step number)` of each slot's latest step (the V1 runner gets
    /// `all_token_ids` of a request that was not in the previous step).
    last_scheduled: Vec<(u32, u64)>,
    /// Steps built so far.
    step_number: u64,
    /// The latest step: drafts in its batch order take the fast path.
    last_step: Option<Py<PySchedulerOutput>>,
    /// Python ints handed out as counts, made once each.
    ints: IntCache,
    /// The latest `num_scheduled_tokens`, privately kept: a step with the same batch and
    /// counts (a steady decode) hands out a copy of it.
    num_scheduled: Option<NumScheduledTemplate>,
    /// The cumulative counters at the latest stats: prefix-cache lookups (first admissions,
    /// then re-admissions: requests, queries, hits each) and speculative decoding.
    prefix_snapshot: [u64; 6],
    spec_snapshot: SpecCounters,
}

/// Cumulative speculative-decoding counters: drafts, draft tokens, accepted tokens, accepted
/// and drafted per position.
#[derive(Default, Clone)]
struct SpecCounters {
    drafts: u64,
    draft_tokens: u64,
    accepted: u64,
    accepted_per_pos: Vec<u64>,
    drafted_per_pos: Vec<u64>,
}

/// Python ints `0..len` made once each and shared (ints are immutable): the computed- and
/// output-token counts of a step are then no allocation each.
#[derive(Default)]
struct IntCache {
    ints: Vec<Option<Py<PyAny>>>,
}

impl IntCache {
    /// Most ints cached (a pool of larger contexts allocates the counts past it).
    const MAX: usize = 1 << 18;

    fn reserve_for(&mut self, max_model_len: usize) {
        let len = (max_model_len + 1).min(Self::MAX);
        if self.ints.len() < len {
            self.ints.resize_with(len, || None);
        }
    }

    /// Prefetches the cached int `v` (if any), which `get` will incref.
    fn prefetch(&self, v: usize) {
        if let Some(Some(obj)) = self.ints.get(v) {
            prefetch::read(obj.as_ptr());
        }
    }

    /// The int `v` (cached when `0 <= v < len`).
    fn get<'py>(&mut self, py: Python<'py>, v: i64) -> PyResult<Bound<'py, PyAny>> {
        let Some(slot) = usize::try_from(v).ok().and_then(|i| self.ints.get_mut(i)) else {
            return Ok(v.into_pyobject(py)?.into_any());
        };
        if let Some(obj) = slot {
            return Ok(refcount::new_ref(obj.bind(py)));
        }
        let obj = v.into_pyobject(py)?.into_any();
        *slot = Some(obj.clone().unbind());
        Ok(obj)
    }
}

/// The latest step's batch and counts, with a private `num_scheduled_tokens` dict of them once
/// two steps in a row had them.
struct NumScheduledTemplate {
    slots: Vec<(u32, u32)>,
    counts: Vec<i32>,
    dict: Option<Py<PyDict>>,
}

/// Builds and reads vLLM's per-step objects for `DFlashRsScheduler` (private to
/// `dflash_rs.vllm`).
#[pyclass(module = "dflash_rs._core", name = "_VllmBridge", frozen)]
pub struct PyVllmBridge {
    scheduler: Py<PyScheduler>,
    types: VllmTypes,
    /// vLLM's V2 model runner: resumed requests travel in `scheduled_new_reqs` only, and no
    /// `all_token_ids` are sent.
    v2: bool,
    /// Async scheduling: drafts are the core's placeholders, and `num_output_tokens` counts
    /// the outputs still in flight.
    async_scheduling: bool,
    /// K, the scheduler's drafts per request (fixed by its config).
    num_spec_tokens: usize,
    state: Guarded<BridgeState>,
}

/// What `engine_outputs` returns: the outputs, the slow entries, the requests whose final
/// output was built here `(request id, finish reason, stop reason)`, and the updated ids.
type EngineOutputs<'py> = (
    Bound<'py, PyList>,
    Vec<SlowEntry>,
    Vec<(Py<PyString>, &'static str, Option<u32>)>,
    Option<Bound<'py, PyList>>,
);

/// One output that needs the adapter's Python: `(position, request id, new tokens, finish
/// reason or None, stop reason or None)`.
type SlowEntry = (
    usize,
    Py<PyString>,
    Py<PyList>,
    Option<&'static str>,
    Option<u32>,
);

#[pymethods]
impl PyVllmBridge {
    #[new]
    // The vLLM classes, each resolved once by the adapter, and two flags.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (scheduler, scheduler_output, cached_request_data, engine_core_output, finish_reason, *, stats, v2, async_scheduling))]
    fn new(
        scheduler: Py<PyScheduler>,
        scheduler_output: &Bound<'_, PyType>,
        cached_request_data: &Bound<'_, PyType>,
        engine_core_output: &Bound<'_, PyAny>,
        finish_reason: &Bound<'_, PyAny>,
        stats: &Bound<'_, PyTuple>,
        v2: bool,
        async_scheduling: bool,
    ) -> PyResult<Self> {
        let reason =
            |name: &str| -> PyResult<Py<PyAny>> { Ok(finish_reason.getattr(name)?.unbind()) };
        let finish_reasons = [
            reason("STOP")?,
            reason("LENGTH")?,
            reason("ABORT")?,
            reason("ERROR")?,
        ];
        let (step_output, cached) = step_output_types(scheduler_output, cached_request_data)?;
        let num_spec_tokens = scheduler.get().with_state(finish_reason.py(), |st| {
            Ok(st.inner.config().num_speculative_tokens)
        })?;
        Ok(Self {
            scheduler,
            types: VllmTypes {
                scheduler_output: step_output,
                cached_request_data: cached,
                engine_core_output: EngineCoreOutputType::new(engine_core_output)?,
                stats: StatsTypes::new(stats)?,
                finish_reasons,
            },
            v2,
            async_scheduling,
            num_spec_tokens,
            state: Guarded::new(BridgeState::default(), "vLLM bridge"),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.scheduler)?;
        visit.call(self.types.scheduler_output.builder.class())?;
        visit.call(self.types.cached_request_data.builder.class())?;
        visit.call(self.types.engine_core_output.builder.type_object())?;
        for builder in [
            &self.types.stats.scheduler,
            &self.types.stats.prefix,
            &self.types.stats.spec,
        ] {
            visit.call(builder.class())?;
        }
        for r in &self.types.finish_reasons {
            visit.call(r)?;
        }
        self.state
            .try_peek(|s| s.last_step.as_ref().map_or(Ok(()), |step| visit.call(step)))
            .unwrap_or(Ok(()))
    }

    /// Plans the core's next step (`Scheduler.schedule`) and, when it admits, resumes,
    /// preempts and reports as finished nobody (a steady decode), builds vLLM's
    /// `SchedulerOutput` for it too: `(step, output)`, with None for the output when the step
    /// needs the adapter's bookkeeping first (it then calls `scheduler_output`).
    #[pyo3(signature = (throttle_prefills, num_spec_tokens))]
    fn schedule<'py>(
        &self,
        py: Python<'py>,
        throttle_prefills: bool,
        num_spec_tokens: usize,
    ) -> PyResult<(Bound<'py, PySchedulerOutput>, Option<Bound<'py, PyAny>>)> {
        let step = PyScheduler::schedule_step(self.scheduler.bind(py), throttle_prefills)?;
        let step = Bound::new(py, step)?;
        let out = step.get();
        let quiet = out.scheduled_new_reqs.bind(py).is_empty()
            && out.preempted_req_ids.bind(py).is_empty()
            && out.finished_req_ids.bind(py).is_empty();
        if !quiet {
            return Ok((step, None));
        }
        let output = self.scheduler_output(&step, &PyList::empty(py), num_spec_tokens)?;
        Ok((step, Some(output)))
    }

    /// vLLM's `SchedulerOutput` for the core step `step`; `new_reqs` are its
    /// `NewRequestData`, built by the adapter.
    fn scheduler_output<'py>(
        &self,
        step: &Bound<'py, PySchedulerOutput>,
        new_reqs: &Bound<'py, PyList>,
        num_spec_tokens: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = step.py();
        let out = step.get();
        let parts = self.state.with(py, |bridge| {
            self.scheduler
                .get()
                .with_state(py, |st| self.build_parts(py, bridge, st, step))
        })?;
        self.types.scheduler_output.build(
            py,
            [
                new_reqs.clone().into_any(),
                parts.cached,
                parts.num_scheduled.into_any(),
                out.total_num_scheduled_tokens.into_pyobject(py)?.into_any(),
                parts.spec.into_any(),
                PyDict::new(py).into_any(),
                out.finished_req_ids.bind(py).clone().into_any(),
                PyList::empty(py).into_any(),
                out.preempted_req_ids.bind(py).clone().into_any(),
                num_spec_tokens.into_pyobject(py)?.into_any(),
            ],
        )
    }

    /// Applies `runner_output` (vLLM's `ModelRunnerOutput`) to the core step `step` and returns
    /// `(outputs, slow, updated_ids)`: one `EngineCoreOutput` per request that got tokens, in
    /// batch order, with None where the adapter must build it (the request is in `slow`, or
    /// `all_slow`, or it finished); `slow` lists those as `(position, request id, tokens,
    /// finish reason, stop reason)`; `updated_ids` (with `want_ids`) the ids of every output.
    #[pyo3(signature = (step, runner_output, slow, *, all_slow, want_ids))]
    fn engine_outputs<'py>(
        &self,
        step: &Bound<'py, PySchedulerOutput>,
        runner_output: &Bound<'py, PyAny>,
        slow: &Bound<'py, PySet>,
        all_slow: bool,
        want_ids: bool,
    ) -> PyResult<EngineOutputs<'py>> {
        let py = step.py();
        let out = step.get();
        let lists = sampled_lists(py, out, runner_output)?;
        // At most one token per entry beyond its drafts: the vector never grows.
        let capacity = lists.len() + out.parts.spec_tokens.len();
        let (mut tokens, mut counts) = (
            Vec::with_capacity(capacity),
            Vec::with_capacity(lists.len()),
        );
        for (i, list) in lists.iter().enumerate() {
            let n = match list {
                Some(list) => extend_tokens(list, &mut tokens, i, "sampled_token_ids")?,
                None => 0,
            };
            counts.push(n);
        }
        let engine_core_output = &self.types.engine_core_output;
        let check_slow = !slow.is_empty();
        self.scheduler.get().with_state(py, |st| {
            st.apply_tokens(py, out, &tokens, &counts)?;
            let update = &st.update;
            // It holds vLLM's `EngineCoreOutput`s (untracked structs) and, later, None for the
            // adapter's slow entries, which it fills with `EngineCoreOutput`s too.
            let mut outputs = ListBuilder::new(py, update.updates.len())?;
            let mut slow_entries = Vec::new();
            let mut finished = Vec::new();
            let ids = want_ids.then(|| PyList::empty(py));
            let slots = &out.parts.slots;
            let mut cursor = 0usize;
            for (position, u) in update.updates.iter().enumerate() {
                // Updates come in batch order, a subsequence of the step's slots.
                while cursor < slots.len() && slots[cursor].0 != u.slot {
                    cursor += 1;
                }
                let Some(sampled) = lists.get(cursor) else {
                    return Err(crate::errors::to_py(
                        py,
                        dflash_core::CoreError::Invariant(format!(
                            "updated slot {} is not in the step's batch",
                            u.slot
                        )),
                    ));
                };
                let new = &update.new_token_ids[u.tokens_start as usize..u.tokens_end as usize];
                // The runner's own list when it holds exactly the new tokens (as vLLM's
                // scheduler does), else a new list.
                let new_tokens = match sampled.as_ref().and_then(|s| s.cast_exact::<PyList>().ok())
                {
                    Some(list) if list.len() == new.len() => refcount::new_ref(list),
                    _ => PyList::new(py, new)?,
                };
                cursor += 1;
                let rid = st.ids.id_of(py, u.slot)?;
                if let Some(ids) = &ids {
                    ids.append(&rid)?;
                }
                let slow_one = all_slow || (check_slow && slow.contains(&rid)?);
                let fast = !slow_one;
                if fast && u.finish_reason.is_none() {
                    outputs.push(
                        engine_core_output
                            .tokens(rid.into_bound(py).into_any(), new_tokens.into_any())?,
                    );
                } else if let (true, Some(reason)) = (fast, u.finish_reason) {
                    // A final output that carries nothing else (no events, stats, logprobs).
                    let stop = u.stop_token;
                    let vllm_reason = self.types.finish_reasons[reason as usize].bind(py);
                    outputs.push(engine_core_output.finished(
                        rid.bind(py).clone().into_any(),
                        new_tokens.into_any(),
                        vllm_reason.clone(),
                        stop.into_pyobject(py)?.into_any(),
                    )?);
                    finished.push((rid, reason.name(), stop));
                } else {
                    slow_entries.push((
                        position,
                        rid,
                        new_tokens.unbind(),
                        u.finish_reason.map(|r| r.name()),
                        u.finish_reason.and(u.stop_token),
                    ));
                    outputs.push(refcount::none(py));
                }
            }
            let outputs = outputs.finish();
            st.forget_finished();
            Ok((outputs, slow_entries, finished, ids))
        })
    }

    /// Installs vLLM's `DraftTokenIds` for the next step; returns how many requests took them.
    /// Drafts in the latest step's batch order are matched by position, others by id.
    fn update_draft_token_ids(&self, draft_token_ids: &Bound<'_, PyAny>) -> PyResult<usize> {
        let py = draft_token_ids.py();
        let ids = draft_token_ids.getattr(intern!(py, "req_ids"))?;
        let lists = draft_token_ids.getattr(intern!(py, "draft_token_ids"))?;
        // SAFETY: `lists` is alive (held here) and its items while it is not changed: the new
        // references are taken before anything else runs.
        let exact = unsafe {
            with_exact_items(py, lists.as_ptr(), |items| {
                items
                    .iter()
                    .map(|&item| Owned::from_borrowed(py, item))
                    .collect::<Vec<_>>()
            })
        };
        let lists: Vec<Owned<'_>> = match exact {
            Some(lists) => lists,
            None => lists
                .extract::<Vec<Bound<'_, PyAny>>>()
                .map_err(|e| {
                    unless_fatal(py, e, || {
                        crate::errors::wrong_type(
                            py,
                            "draft_token_ids must be a list of token lists",
                        )
                    })
                })?
                .into_iter()
                .map(Owned::new)
                .collect(),
        };
        let n = ids.len()?;
        if n != lists.len() {
            return Err(invalid(
                py,
                format!(
                    "DraftTokenIds has {n} req_ids but {} draft lists",
                    lists.len()
                ),
            ));
        }
        self.state.with(py, |bridge| {
            let last = bridge.last_step.as_ref().map(|s| s.clone_ref(py));
            let in_step_order = match &last {
                Some(step) => same_ids(&ids, step.get().req_ids.bind(py))?,
                None => false,
            };
            // K drafts per request at most (more are refused): the vector rarely grows.
            let capacity = n * self.num_spec_tokens;
            let (mut tokens, mut counts) = (Vec::with_capacity(capacity), Vec::with_capacity(n));
            for (i, list) in lists.iter().enumerate() {
                counts.push(extend_tokens(list, &mut tokens, i, "draft_token_ids")?);
            }
            self.scheduler.get().with_state(py, |st| {
                if let (true, Some(step)) = (in_step_order, &last) {
                    let slots = &step.get().parts.slots;
                    let taken = st
                        .inner
                        .update_draft_token_ids_for_slots(slots, &tokens, &counts)
                        .py(py)?;
                    let mut start = 0usize;
                    for ((&(slot, generation), list), &c) in slots.iter().zip(&lists).zip(&counts) {
                        let end = start + c as usize;
                        bridge.keep_drafts(st, slot, generation, list, &tokens[start..end]);
                        start = end;
                    }
                    return Ok(taken);
                }
                let names: Vec<String> = ids
                    .try_iter()?
                    .map(|id| id?.extract::<String>())
                    .collect::<PyResult<_>>()
                    .map_err(|e| {
                        unless_fatal(py, e, || {
                            crate::errors::wrong_type(py, "DraftTokenIds.req_ids must be str")
                        })
                    })?;
                let mut start = 0usize;
                let pairs: Vec<(&str, &[u32])> = names
                    .iter()
                    .zip(&counts)
                    .map(|(id, &c)| {
                        let s = start;
                        start += c as usize;
                        (id.as_str(), &tokens[s..start])
                    })
                    .collect();
                let taken = st.inner.update_draft_token_ids(pairs).py(py)?;
                let mut start = 0usize;
                for ((id, list), &c) in names.iter().zip(&lists).zip(&counts) {
                    let end = start + c as usize;
                    if let Some(slot) = st.inner.slot_of(id) {
                        let generation = st.inner.requests().generation(slot);
                        bridge.keep_drafts(st, slot, generation, list, &tokens[start..end]);
                    }
                    start = end;
                }
                Ok(taken)
            })
        })
    }

    /// vLLM's `SchedulerStats` for the step just applied (`with_spec`: its
    /// `SpecDecodingStats` too, None when no drafts were verified since the last stats), from
    /// the core's cumulative counters less those at the previous stats. `invalid` holds
    /// `(scheduled, invalid)` draft counts of verified requests whose drafts were padded with
    /// placeholders (left out of the draft counts, as vLLM does); `prefix_reset` marks a
    /// prefix-cache reset since the previous stats. Prefix-cache lookups are counted at first
    /// admissions and re-admissions after a preemption apart.
    #[pyo3(signature = (*, with_spec, invalid, prefix_reset))]
    fn scheduler_stats<'py>(
        &self,
        py: Python<'py>,
        with_spec: bool,
        invalid: Vec<(usize, u64)>,
        prefix_reset: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let k = self.num_spec_tokens;
        let (running, waiting, skipped, usage, prefix, spec) =
            self.scheduler.get().with_state(py, |st| {
                let inner = &st.inner;
                let s = inner.stats();
                let (a, r) = (&s.admitted_prefix, &s.resumed_prefix);
                Ok((
                    inner.running().len(),
                    inner.num_waiting(),
                    inner.num_deferred_waiting(),
                    inner.kv().usage(),
                    [a.requests, a.queries, a.hits, r.requests, r.queries, r.hits],
                    SpecCounters {
                        drafts: s.num_drafts,
                        draft_tokens: s.num_draft_tokens,
                        accepted: s.num_accepted_tokens,
                        accepted_per_pos: s.num_accepted_tokens_per_pos.clone(),
                        drafted_per_pos: s.num_draft_tokens_per_pos(),
                    },
                ))
            })?;
        let (prefix_delta, spec_delta) = self.state.with(py, |bridge| {
            let old = std::mem::replace(&mut bridge.prefix_snapshot, prefix);
            let prefix_delta: [i64; 6] = std::array::from_fn(|i| prefix[i] as i64 - old[i] as i64);
            let spec_delta = if with_spec {
                let old = std::mem::replace(&mut bridge.spec_snapshot, spec.clone());
                spec_delta(&spec, &old, k, &invalid)
            } else {
                None
            };
            Ok((prefix_delta, spec_delta))
        })?;
        let t = &self.types.stats;
        let reset = pyo3::types::PyBool::new(py, prefix_reset)
            .to_owned()
            .into_any();
        let mut prefix_values = vec![reset];
        for v in prefix_delta {
            prefix_values.push(v.into_pyobject(py)?.into_any());
        }
        let given: Vec<(usize, &Bound<'py, PyAny>)> = t
            .prefix_fields
            .iter()
            .copied()
            .zip(prefix_values.iter())
            .collect();
        let prefix_stats = t.prefix.build(py, &given)?;
        let spec_stats = match spec_delta {
            None => py.None().into_bound(py),
            Some(d) => {
                let f = &t.spec_fields;
                let values = [
                    (k as i64).into_pyobject(py)?.into_any(),
                    d.drafts.into_pyobject(py)?.into_any(),
                    d.draft_tokens.into_pyobject(py)?.into_any(),
                    d.accepted.into_pyobject(py)?.into_any(),
                    PyList::new(py, &d.accepted_per_pos)?.into_any(),
                    PyList::new(py, &d.drafted_per_pos)?.into_any(),
                ];
                let given: Vec<(usize, &Bound<'py, PyAny>)> =
                    f.iter().copied().zip(values.iter()).collect();
                t.spec.build(py, &given)?
            }
        };
        let f = &t.scheduler_fields;
        let values = [
            running.into_pyobject(py)?.into_any(),
            (waiting as i64 - skipped as i64)
                .into_pyobject(py)?
                .into_any(),
            skipped.into_pyobject(py)?.into_any(),
            usage.into_pyobject(py)?.into_any(),
            prefix_stats,
            spec_stats,
        ];
        let given: Vec<(usize, &Bound<'py, PyAny>)> =
            f.iter().copied().zip(values.iter()).collect();
        t.scheduler.build(py, &given)
    }

    /// Whether the stats dataclasses are built by setting their fields (`dataclass_build`),
    /// rather than by calling them.
    #[getter]
    fn builds_stats_directly(&self) -> bool {
        let t = &self.types.stats;
        t.scheduler.is_direct() && t.prefix.is_direct() && t.spec.is_direct()
    }

    /// Whether `SchedulerOutput` and its `CachedRequestData` are built from a template of their
    /// fields (`dataclass_build`), rather than by calling the classes.
    #[getter]
    fn builds_step_directly(&self) -> bool {
        self.types.scheduler_output.builder.is_direct()
            && self.types.cached_request_data.builder.is_direct()
    }

    /// Whether `EngineCoreOutput`s are built by filling their slots (`struct_slots`), rather
    /// than by calling the class (a layout the bridge does not know).
    #[getter]
    fn builds_outputs_directly(&self) -> bool {
        self.types.engine_core_output.builder.is_direct()
    }

    /// Forgets which requests the previous step scheduled: the V1 runner then gets every
    /// cached request's `all_token_ids` again (after `reset_prefix_cache` preempted them all).
    fn forget_previous_step(&self, py: Python<'_>) -> PyResult<()> {
        self.state.with(py, |bridge| {
            bridge.step_number += 1;
            Ok(())
        })
    }
}

/// The Python objects of one `SchedulerOutput`, before the dataclass is built.
struct StepParts<'py> {
    cached: Bound<'py, PyAny>,
    num_scheduled: Bound<'py, PyDict>,
    spec: Bound<'py, PyDict>,
}

impl PyVllmBridge {
    fn build_parts<'py>(
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

impl BridgeState {
    /// `num_scheduled_tokens` of a step: a copy of a private one when the batch and the counts
    /// are those of the previous steps (a steady decode), else a new dict. The private copy is
    /// made on the second step of a run of equal steps, so changing batches pay no copy.
    fn num_scheduled_tokens<'py>(
        &mut self,
        py: Python<'py>,
        slots: &[(u32, u32)],
        counts: &[i32],
        req_ids: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let same = self
            .num_scheduled
            .as_ref()
            .is_some_and(|t| t.slots == slots && t.counts == counts);
        if same {
            if let Some(dict) = self.num_scheduled.as_ref().and_then(|t| t.dict.as_ref()) {
                return dict.bind(py).copy();
            }
        }
        let dict = PyDict::new(py);
        for (rid, &n) in req_ids.iter().zip(counts) {
            dict.set_item(rid, n)?;
        }
        self.num_scheduled = Some(NumScheduledTemplate {
            slots: slots.to_vec(),
            counts: counts.to_vec(),
            dict: if same {
                Some(dict.copy()?.unbind())
            } else {
                None
            },
        });
        Ok(dict)
    }

    /// Remembers the runner's draft list of a slot when the core took exactly its `tokens` as
    /// the request's drafts (exact lists only: the spec dict may hand it on); forgets the slot's
    /// list otherwise, so a list is only ever handed on for the drafts the core holds.
    fn keep_drafts(
        &mut self,
        st: &State,
        slot: u32,
        generation: u32,
        list: &Bound<'_, PyAny>,
        tokens: &[u32],
    ) {
        let s = slot as usize;
        if self.drafts.len() <= s {
            self.drafts.resize_with(s + 1, || None);
        }
        let taken = st
            .inner
            .requests()
            .get(slot)
            .is_ok_and(|r| r.spec_token_ids.as_slice() == tokens);
        let kept = match list.cast_exact::<PyList>() {
            Ok(list) if taken => Some((generation, refcount::new_ref(list).unbind())),
            _ => None,
        };
        if let Some((_, old)) = std::mem::replace(&mut self.drafts[s], kept) {
            // SAFETY: the slot's reference, released once; the caller is attached.
            unsafe { refcount::decref(old.into_ptr()) };
        }
    }

    /// Prefetches the runner's draft list kept for a slot (its length is read next step).
    fn prefetch_drafts(&self, slot: u32) {
        if let Some(Some((_, list))) = self.drafts.get(slot as usize) {
            prefetch::read(list.as_ptr());
        }
    }

    /// The runner's draft list of a slot, or a copy of its first `num_drafts` items: what
    /// vLLM's scheduler hands on too (`request.spec_token_ids`). The core read its tokens when
    /// the runner handed it in; that it still holds at least `num_drafts` is checked here (its
    /// items are not read again: they are the runner's own list).
    fn reusable_drafts<'py>(
        &self,
        py: Python<'py>,
        slot: u32,
        generation: u32,
        num_drafts: usize,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let Some(Some((g, list))) = self.drafts.get(slot as usize) else {
            return Ok(None);
        };
        let list = list.bind(py);
        let len = list.len();
        if *g != generation || len < num_drafts {
            return Ok(None);
        }
        if len == num_drafts {
            Ok(Some(refcount::new_ref(list)))
        } else {
            Ok(Some(list.get_slice(0, num_drafts).cast_into::<PyList>()?))
        }
    }
}

/// A scheduled token as vLLM shows it: a placeholder draft is -1.
fn vllm_token(t: u32) -> i64 {
    if t == PLACEHOLDER_TOKEN {
        -1
    } else {
        i64::from(t)
    }
}

/// Whether `ids` (any sequence of str) names exactly `expected`, in order; compared element by
/// element (the interned strings make most comparisons a pointer check).
fn same_ids(ids: &Bound<'_, PyAny>, expected: &Bound<'_, PyTuple>) -> PyResult<bool> {
    if ids.len()? != expected.len() {
        return Ok(false);
    }
    let py = ids.py();
    // The common case: the very same str objects, compared as pointers (nothing dereferenced).
    // SAFETY: both are alive and the closures run no Python code.
    let identical = unsafe {
        with_exact_items(py, ids.as_ptr(), |a| {
            with_exact_items(py, expected.as_ptr(), |b| a == b).unwrap_or(false)
        })
    };
    if identical == Some(true) {
        return Ok(true);
    }
    for (a, b) in ids.try_iter()?.zip(expected.iter()) {
        let a = a?;
        if !a.is(&b) && !a.eq(&b)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Each batch entry's sampled tokens (None: none sampled), from a vLLM `ModelRunnerOutput`
/// listed in the step's order or in any order (matched through `req_id_to_index`).
fn sampled_lists<'py>(
    py: Python<'py>,
    out: &PySchedulerOutput,
    runner_output: &Bound<'py, PyAny>,
) -> PyResult<Vec<Option<Owned<'py>>>> {
    let expected = out.req_ids.bind(py);
    let n = expected.len();
    let sampled = runner_output.getattr(intern!(py, "sampled_token_ids"))?;
    if sampled.is_none() || sampled.len()? == 0 {
        return Ok((0..n).map(|_| None).collect());
    }
    let runner_ids = runner_output.getattr(intern!(py, "req_ids"))?;
    if same_ids(&runner_ids, expected)? {
        if sampled.len()? != n {
            return Err(invalid(
                py,
                format!(
                    "ModelRunnerOutput has {} sampled lists for {n} requests",
                    sampled.len()?
                ),
            ));
        }
        // SAFETY: `sampled` is alive (held here) and its items while it is not changed: the
        // new references are taken before anything else runs.
        let items = unsafe {
            with_exact_items(py, sampled.as_ptr(), |items| {
                items
                    .iter()
                    .map(|&item| Some(Owned::from_borrowed(py, item)))
                    .collect::<Vec<_>>()
            })
        };
        if let Some(items) = items {
            return Ok(items);
        }
        return (0..n)
            .map(|i| sampled.get_item(i).map(|v| Some(Owned::new(v))))
            .collect();
    }
    let index = runner_output.getattr(intern!(py, "req_id_to_index"))?;
    expected
        .iter()
        .map(|rid| {
            let i = index.get_item(&rid).map_err(|e| {
                unless_fatal(py, e, || {
                    invalid(
                        py,
                        format!("ModelRunnerOutput has no output for scheduled request {rid}"),
                    )
                })
            })?;
            sampled.get_item(i).map(|v| Some(Owned::new(v)))
        })
        .collect()
}

/// Appends the token ids of one list to `tokens` (an exact list of ints is read in place;
/// anything else through the checked conversion, whose errors name `what[i]`); returns how many.
fn extend_tokens(
    list: &Bound<'_, PyAny>,
    tokens: &mut Vec<u32>,
    i: usize,
    what: &str,
) -> PyResult<u32> {
    let before = tokens.len();
    if push_exact_token_ids(list.as_borrowed(), tokens) {
        return Ok((tokens.len() - before) as u32);
    }
    let parsed = token_ids(list, format_args!("{what}[{i}]"))?;
    tokens.extend_from_slice(&parsed);
    Ok(parsed.len() as u32)
}

/// One step's speculative-decoding stats: the counters since `old`, the draft counts less the
/// placeholders that padded `invalid` requests' drafts (`(scheduled, invalid)`: the last
/// `invalid` of `scheduled` positions), as vLLM counts them; None when no drafts were verified.
fn spec_delta(
    new: &SpecCounters,
    old: &SpecCounters,
    k: usize,
    invalid: &[(usize, u64)],
) -> Option<SpecDelta> {
    if new.drafts == old.drafts {
        return None;
    }
    let per_pos = |n: &[u64], o: &[u64]| -> Vec<i64> {
        (0..k)
            .map(|i| n.get(i).copied().unwrap_or(0) as i64 - o.get(i).copied().unwrap_or(0) as i64)
            .collect()
    };
    let mut delta = SpecDelta {
        drafts: new.drafts as i64 - old.drafts as i64,
        draft_tokens: new.draft_tokens as i64 - old.draft_tokens as i64,
        accepted: new.accepted as i64 - old.accepted as i64,
        accepted_per_pos: per_pos(&new.accepted_per_pos, &old.accepted_per_pos),
        drafted_per_pos: per_pos(&new.drafted_per_pos, &old.drafted_per_pos),
    };
    for &(scheduled, n) in invalid {
        delta.draft_tokens -= n as i64;
        for i in scheduled.saturating_sub(n as usize)..scheduled {
            if let Some(c) = delta.drafted_per_pos.get_mut(i) {
                *c -= 1;
            }
        }
    }
    Some(delta)
}

/// [`spec_delta`]'s result.
struct SpecDelta {
    drafts: i64,
    draft_tokens: i64,
    accepted: i64,
    accepted_per_pos: Vec<i64>,
    drafted_per_pos: Vec<i64>,
}
