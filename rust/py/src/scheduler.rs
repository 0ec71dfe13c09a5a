//! `dflash_rs.Scheduler`'s methods: the per-step loop in Rust, crossing into Python once per
//! call with flat arrays. Each method converts its arguments, runs the core under the lock and
//! maps errors; the object and its state are in `scheduler_state.rs`, the jobs on the state in
//! `step_output.rs`, `step_update.rs` and `draft_install.rs`.

use dflash_core::{CoreError, KvEvent, PauseState};
use pyo3::gc::PyVisit;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};
use pyo3::PyTraverseError;
use std::borrow::Cow;

use crate::convert::{strict_bool, token_ids, Flag, RequestId, Text};
use crate::draft_dict;
use crate::errors::{to_py, unless_fatal, wrong_type, IntoPyResult};
use crate::outputs::{OutputArg, PySchedulerOutput, PyUpdateResult};
use crate::scheduler_args::{config_from_py, finish_reason_from_name, request_spec};
use crate::scheduler_state::PyScheduler;

#[pymethods]
impl PyScheduler {
    #[new]
    fn new(py: Python<'_>, config: &Bound<'_, PyAny>) -> PyResult<Self> {
        let core_config = config_from_py(config)?;
        Self::create(py, core_config, config.clone().unbind())
    }

    /// The configuration this scheduler was built from.
    #[getter]
    fn config(&self, py: Python<'_>) -> Py<PyAny> {
        self.config_object().clone_ref(py)
    }

    /// Garbage-collector support (see [`PyScheduler::traverse`]).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        self.traverse(visit)
    }

    /// Enqueues a request (hashing its prompt blocks in Rust).
    fn add_request(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        let spec = request_spec(request, self.max_model_len())?;
        let id = spec.request_id.clone();
        self.with_state(py, |st| {
            let inner = &mut st.inner;
            let slot = inner.add_request(spec).py(py)?;
            st.ids.intern(py, slot, &id);
            Ok(())
        })
    }

    /// Plans one step. With `throttle_prefills` (vLLM's data-parallel prefill throttle) the
    /// step holds prefills back: running requests keep decoding, prefill chunks and admissions
    /// that need a prefill wait (unless nothing decodes, or the last release left the queue
    /// backed up). `config.local_prefill_interval` holds them back the same way.
    #[pyo3(signature = (throttle_prefills=Flag(false)), text_signature = "(self, throttle_prefills=False)")]
    fn schedule(slf: &Bound<'_, Self>, throttle_prefills: Flag) -> PyResult<PySchedulerOutput> {
        let Flag(throttle) = throttle_prefills;
        Self::schedule_step(slf, throttle)
    }

    /// vLLM's `prefill_capacity_bound`: the last step that did not hold prefills back left
    /// requests waiting that it could have admitted, so no step holds them back until one
    /// drains the queue.
    #[getter]
    fn prefill_capacity_bound(&self, py: Python<'_>) -> PyResult<bool> {
        self.with_state(py, |st| Ok(st.inner.prefill_capacity_bound()))
    }

    /// Applies the model's output for `output`'s step; returns one `RequestOutput` per request
    /// that received tokens, in batch order, then one (no tokens, finish reason "error") per
    /// request the scheduler ended on its own since the previous update. Drafts in
    /// `runner_output.draft_token_ids` are installed for the next step.
    fn update_from_output(
        &self,
        py: Python<'_>,
        output: OutputArg<'_, '_>,
        runner_output: &Bound<'_, PyAny>,
    ) -> PyResult<Py<PyList>> {
        self.apply_output(py, &output, runner_output, |st| st.request_outputs(py))
    }

    /// `update_from_output` returning flat arrays (`UpdateResult`) instead of one Python
    /// object per request: the same update, for engines that consume arrays.
    fn update_from_output_arrays(
        &self,
        py: Python<'_>,
        output: OutputArg<'_, '_>,
        runner_output: &Bound<'_, PyAny>,
    ) -> PyResult<PyUpdateResult> {
        let slots = &output.get().parts.slots;
        self.apply_output(py, &output, runner_output, |st| {
            PyUpdateResult::build(py, &st.update, slots, |slot| st.ids.id_of(py, slot))
        })
    }

    /// Gives up `output`'s step (its model output is lost, e.g. the runner raised) together with
    /// any younger step in flight: their requests roll back and later steps schedule them
    /// again. Returns how many steps were abandoned (0 for a step that scheduled nothing or
    /// was abandoned already). See `abandon.rs` in the core for what rolls back.
    fn abandon_step(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PySchedulerOutput>,
    ) -> PyResult<usize> {
        let out = output.get();
        self.with_state(py, |st| {
            st.check_owner(py, out)?;
            if out.parts.slots.is_empty() {
                return Ok(0); // an empty step awaits no output
            }
            st.inner.abandon_step(out.step_id).py(py)
        })
    }

    /// Installs draft tokens for the next step: `{req_id: [token, ...]}`. Unknown, finished,
    /// waiting and prefill-chunk requests are ignored. Returns how many requests took drafts.
    fn update_draft_token_ids(
        &self,
        py: Python<'_>,
        draft_token_ids: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let dict = draft_dict::as_draft_dict(draft_token_ids)?;
        if let Some(applied) = self.with_state(py, |st| st.install_exact_draft_dict(py, &dict))? {
            return Ok(applied);
        }
        let drafts = draft_dict::read_general(&dict)?;
        self.with_state(py, |st| st.install_draft_texts(py, &drafts))
    }

    /// Drafts for the requests of `output`'s batch, as flat tokens + per-request counts
    /// (no Python list per request).
    fn update_draft_token_ids_from_arrays(
        &self,
        py: Python<'_>,
        output: OutputArg<'_, '_>,
        draft_tokens: &Bound<'_, PyAny>,
        num_draft_tokens: &Bound<'_, PyAny>,
    ) -> PyResult<usize> {
        let tokens = token_ids(draft_tokens, "draft_tokens")?;
        let counts = token_ids(num_draft_tokens, "num_draft_tokens")?;
        let out = output.get();
        self.with_state(py, |st| {
            st.check_owner(py, out)?;
            st.inner
                .update_draft_token_ids_for_slots(&out.parts.slots, &tokens, &counts)
                .py(py)
        })
    }

    /// Finishes requests (default: aborted); unknown or finished ids are ignored. Returns the
    /// ids actually finished.
    #[pyo3(
        signature = (request_ids, status=Text(Cow::Borrowed("abort"))),
        text_signature = "(self, request_ids, status='abort')"
    )]
    fn finish_requests(
        &self,
        py: Python<'_>,
        request_ids: &Bound<'_, PyAny>,
        status: Text<'_>,
    ) -> PyResult<Vec<String>> {
        let reason = finish_reason_from_name(py, &status)?;
        let not_ids = || wrong_type(py, "request_ids must be a str or an iterable of str");
        let ids: Vec<String> = if let Ok(s) = request_ids.extract::<String>() {
            vec![s]
        } else {
            // Any iterable (list, tuple, set, dict keys, generator); what its iteration raises
            // propagates.
            let mut ids = Vec::new();
            for item in request_ids
                .try_iter()
                .map_err(|e| unless_fatal(py, e, not_ids))?
            {
                ids.push(
                    item?
                        .extract::<String>()
                        .map_err(|e| unless_fatal(py, e, not_ids))?,
                );
            }
            ids
        };
        self.with_state(py, |st| {
            let done = st
                .inner
                .finish_requests(ids.iter().map(String::as_str), reason)
                .py(py)?;
            st.forget_finished();
            Ok(done)
        })
    }

    /// Whether the id is live (waiting or running).
    fn has_request(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<bool> {
        self.with_state(py, |st| Ok(st.inner.slot_of(&request_id).is_some()))
    }

    fn has_unfinished_requests(&self, py: Python<'_>) -> PyResult<bool> {
        self.with_state(py, |st| Ok(st.inner.num_unfinished() > 0))
    }

    fn get_num_unfinished_requests(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_state(py, |st| Ok(st.inner.num_unfinished()))
    }

    /// (running, waiting) counts.
    fn get_request_counts(&self, py: Python<'_>) -> PyResult<(usize, usize)> {
        self.with_state(py, |st| {
            Ok((st.inner.running().len(), st.inner.num_waiting()))
        })
    }

    /// Empties the prefix cache; False while any block is held. With
    /// `reset_running_requests=True` every running request is first preempted as by
    /// `preempt_all_running(drop_stale_outputs=True)`, so the reset always succeeds (vLLM 0.33).
    #[pyo3(
        signature = (reset_running_requests=None),
        text_signature = "(self, reset_running_requests=False)"
    )]
    fn reset_prefix_cache(
        &self,
        py: Python<'_>,
        reset_running_requests: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let preempt = match reset_running_requests {
            Some(flag) => strict_bool(flag, "reset_running_requests")?,
            None => false,
        };
        if !preempt {
            return self.with_state(py, |st| Ok(st.inner.reset_prefix_cache()));
        }
        self.with_state(py, |st| {
            st.inner.reset_prefix_cache_preempting_running().py(py)?;
            Ok(true)
        })
    }

    /// Preempts every running request, last first, so they head the waiting queue in running
    /// order; returns their ids in preemption order (the next step also reports them in
    /// `preempted_req_ids`). With `drop_stale_outputs`, the output of their steps already
    /// scheduled is dropped when it arrives (no tokens, no stats) and they may resume in the
    /// next step; otherwise it is delivered as for any preemption, and they resume after it.
    #[pyo3(signature = (*, drop_stale_outputs))]
    fn preempt_all_running(
        &self,
        py: Python<'_>,
        drop_stale_outputs: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Py<PyString>>> {
        let drop = strict_bool(drop_stale_outputs, "drop_stale_outputs")?;
        self.with_state(py, |st| {
            let ids = st.inner.preempt_all_running(drop).py(py)?;
            ids.iter()
                .map(|id| {
                    let slot = st
                        .inner
                        .slot_of(id)
                        .ok_or_else(|| to_py(py, CoreError::Invariant(format!("{id} vanished"))))?;
                    st.ids.id_of(py, slot)
                })
                .collect()
        })
    }

    /// What `schedule()` may schedule: "unpaused", "paused_new" (running requests only, no
    /// admission) or "paused_all" (nothing; steps still report finished and preempted ids).
    #[getter]
    fn pause_state(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with_state(py, |st| Ok(st.inner.pause_state().name()))
    }

    /// Sets the pause state (see `pause_state`); takes effect at the next `schedule()`.
    fn set_pause_state(&self, py: Python<'_>, state: &Bound<'_, PyAny>) -> PyResult<()> {
        let name: String = state.extract().map_err(|e| {
            unless_fatal(py, e, || {
                wrong_type(
                    py,
                    "pause state must be \"unpaused\", \"paused_new\" or \"paused_all\"",
                )
            })
        })?;
        let pause = PauseState::from_name(&name).py(py)?;
        self.with_state(py, |st| {
            st.inner.set_pause_state(pause);
            Ok(())
        })
    }

    /// Holds a waiting request back from admission (`hold=True`), or releases it: vLLM's
    /// structured-output requests whose grammar is still compiling. A held request keeps its
    /// queue place and counts as a skipped waiting request until admitted or finished.
    /// `KeyError` for an unknown id, `ValueError` for a request that has run.
    fn set_admission_hold(
        &self,
        py: Python<'_>,
        request_id: RequestId<'_>,
        hold: bool,
    ) -> PyResult<()> {
        self.with_state(py, |st| {
            st.inner.set_admission_hold(&request_id, hold).py(py)
        })
    }

    /// Whether a live request is held back from admission.
    fn is_admission_held(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<bool> {
        self.with_state(py, |st| st.inner.is_admission_held(&request_id).py(py))
    }

    /// Held requests the last `schedule()` passed over (the ones its admission loop reached),
    /// in queue order.
    fn held_passed_over(&self, py: Python<'_>) -> PyResult<Vec<Py<PyString>>> {
        self.with_state(py, |st| {
            let slots = st.inner.held_passed_over().to_vec();
            slots.iter().map(|&s| st.ids.id_of(py, s)).collect()
        })
    }

    /// Blocks held by a live request.
    fn block_ids(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<Vec<u32>> {
        self.with_state(py, |st| {
            Ok(st.live(py, &request_id)?.blocks.block_ids.clone())
        })
    }

    /// Computed tokens of a live request.
    fn num_computed_tokens(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<usize> {
        self.with_state(py, |st| Ok(st.live(py, &request_id)?.num_computed_tokens))
    }

    /// Async scheduling: tokens the steps in flight will still add to a live request (sampled
    /// tokens plus drafts), already counted in its computed tokens.
    fn num_output_placeholders(
        &self,
        py: Python<'_>,
        request_id: RequestId<'_>,
    ) -> PyResult<usize> {
        self.with_state(py, |st| {
            Ok(st.live(py, &request_id)?.num_output_placeholders)
        })
    }

    /// The KV-cache events recorded since the last call, oldest first (none unless
    /// `SchedulerConfig(kv_events=True)`): `("stored", request_id, first_block_index,
    /// parent_block_id, block_ids, token_ids)` (parent 0: none; the blocks' tokens, then the
    /// `hash_lookahead_tokens` after the last block), `("removed", block_id)`, `("cleared",)`.
    fn take_kv_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let events = self.with_state(py, |st| Ok(st.inner.take_kv_events()))?;
        let list = PyList::empty(py);
        for e in events {
            let item = match e {
                KvEvent::Stored {
                    request_id,
                    first,
                    parent,
                    blocks,
                    tokens,
                } => (
                    intern!(py, "stored"),
                    request_id,
                    first,
                    parent,
                    blocks,
                    tokens,
                )
                    .into_pyobject(py)?,
                KvEvent::Removed { block } => (intern!(py, "removed"), block).into_pyobject(py)?,
                KvEvent::Cleared => PyTuple::new(py, [intern!(py, "cleared")])?,
            };
            list.append(item)?;
        }
        Ok(list)
    }

    /// Known tokens (prompt + outputs) of a live request.
    fn all_token_ids(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<Vec<u32>> {
        self.with_state(py, |st| Ok(st.live(py, &request_id)?.tokens.clone()))
    }

    /// Status of a live request: "waiting", "running" or "preempted".
    fn request_status(&self, py: Python<'_>, request_id: RequestId<'_>) -> PyResult<&'static str> {
        self.with_state(py, |st| {
            Ok(match st.live(py, &request_id)?.status {
                dflash_core::RequestStatus::Waiting => "waiting",
                dflash_core::RequestStatus::Running => "running",
                dflash_core::RequestStatus::Preempted => "preempted",
                dflash_core::RequestStatus::Finished(_) => "finished",
            })
        })
    }

    /// Running request ids, in running order.
    fn running_request_ids(&self, py: Python<'_>) -> PyResult<Vec<Py<PyString>>> {
        self.with_state(py, |st| {
            st.inner
                .running()
                .iter()
                .map(|&s| st.ids.id_of(py, s))
                .collect()
        })
    }

    /// Waiting request ids, in admission order.
    fn waiting_request_ids(&self, py: Python<'_>) -> PyResult<Vec<Py<PyString>>> {
        self.with_state(py, |st| {
            st.inner
                .waiting_in_order()
                .iter()
                .map(|&s| st.ids.id_of(py, s))
                .collect()
        })
    }

    /// Lookahead slots the active policy reserves past each running request's scheduled tokens.
    #[getter]
    fn lookahead_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_state(py, |st| Ok(st.inner.lookahead_tokens()))
    }

    /// Lookahead the ownership contract requires for the configured method (K+1 for DFlash).
    #[getter]
    fn required_lookahead_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_state(py, |st| Ok(st.inner.config().required_lookahead()))
    }

    #[getter]
    fn kv_cache_usage(&self, py: Python<'_>) -> PyResult<f64> {
        self.with_state(py, |st| Ok(st.inner.kv().usage()))
    }

    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        self.with_state(py, |st| Ok(st.inner.kv().num_free_blocks()))
    }

    /// Counters: preemptions, prefix-cache queries/hits, speculative drafts/accepted, ...
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.with_state(py, |st| {
            let inner = &st.inner;
            let s = inner.stats();
            let p = inner.prefix_cache_stats();
            let d = PyDict::new(py);
            d.set_item("num_steps", s.num_steps)?;
            d.set_item("num_preemptions", s.num_preemptions)?;
            d.set_item("num_finished", s.num_finished)?;
            d.set_item("num_running", inner.running().len())?;
            d.set_item("num_waiting", inner.num_waiting())?;
            d.set_item("kv_cache_usage", inner.kv().usage())?;
            d.set_item("num_free_blocks", inner.kv().num_free_blocks())?;
            d.set_item("prefix_cache_requests", p.requests)?;
            d.set_item("prefix_cache_queries", p.queries)?;
            d.set_item("prefix_cache_hits", p.hits)?;
            for (name, a) in [
                ("admitted", &s.admitted_prefix),
                ("resumed", &s.resumed_prefix),
            ] {
                d.set_item(format!("prefix_cache_{name}_requests"), a.requests)?;
                d.set_item(format!("prefix_cache_{name}_queries"), a.queries)?;
                d.set_item(format!("prefix_cache_{name}_hits"), a.hits)?;
            }
            d.set_item("spec_num_drafts", s.num_drafts)?;
            d.set_item("spec_num_draft_tokens", s.num_draft_tokens)?;
            d.set_item("spec_num_accepted_tokens", s.num_accepted_tokens)?;
            d.set_item(
                "spec_num_accepted_tokens_per_pos",
                s.num_accepted_tokens_per_pos.clone(),
            )?;
            d.set_item(
                "spec_num_draft_tokens_per_pos",
                s.num_draft_tokens_per_pos(),
            )?;
            d.set_item("lookahead_tokens", inner.lookahead_tokens())?;
            Ok(d)
        })
    }

    /// Raises `InvariantError` if any invariant (pool accounting, ref counts, queues, block-table
    /// rows, the lookahead ownership contract) is broken.
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with_state(py, |st| st.inner.check_invariants().py(py))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        self.with_state(py, |st| {
            let inner = &st.inner;
            let c = inner.config();
            Ok(format!(
                "Scheduler(num_blocks={}, block_size={}, method={}, K={}, lookahead={}, running={}, waiting={})",
                c.num_blocks,
                c.block_size,
                c.spec_method.name(),
                c.num_speculative_tokens,
                inner.lookahead_tokens(),
                inner.running().len(),
                inner.num_waiting()
            ))
        })
    }
}
