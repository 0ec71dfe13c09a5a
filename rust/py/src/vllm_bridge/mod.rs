//! `_VllmBridge`: the vLLM drop-in's per-step objects, built here in one pass instead of one
//! Python call per request. It builds vLLM's `SchedulerOutput` (its `CachedRequestData` and the
//! per-request dicts), applies `ModelRunnerOutput.sampled_token_ids` and builds one
//! `EngineCoreOutput` per request that got tokens, and reads `DraftTokenIds`. The vLLM classes
//! are resolved once, by the adapter (`dflash_rs.vllm`), so the objects are exactly vLLM's.
//!
//! What the adapter still does in Python is what is rare: admissions (`NewRequestData` needs the
//! vLLM `Request`), preemptions, and outputs that carry more than tokens (events, prefill
//! stats, logprobs, a finish), which come back as "slow" entries for it to fill in.
//!
//! The class and its methods are here; `vllm_types` resolves vLLM's classes once,
//! `bridge_state` keeps what the bridge remembers between steps, `step_parts` builds a step's
//! dicts and `CachedRequestData`, and `runner_reads` reads what the runner hands back.

mod bridge_state;
mod runner_reads;
mod step_parts;
mod vllm_types;

use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySet, PyString, PyTuple, PyType};
use pyo3::PyTraverseError;

use crate::errors::{invalid, unless_fatal, IntoPyResult};
use crate::guarded::Guarded;
use crate::outputs::PySchedulerOutput;
use crate::refcount::{self, Owned};
use crate::scheduler_state::PyScheduler;
use crate::seq_items::{with_exact_items, ListBuilder};

use bridge_state::{BridgeState, SpecCounters};
use runner_reads::{extend_tokens, same_ids, sampled_lists, spec_delta};
use vllm_types::{step_output_types, EngineCoreOutputType, StatsTypes, VllmTypes};

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
