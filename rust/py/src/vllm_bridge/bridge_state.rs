//! The bridge's memory between steps: per-slot draft lists and latest steps, cached ints,
//! the steady decode's `num_scheduled_tokens`, and the counters at the latest stats.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use dflash_core::prefetch;

use crate::outputs::PySchedulerOutput;
use crate::refcount;
use crate::scheduler_state::State;

/// Per-slot memory of the bridge, keyed by the slot's generation so that a reused slot never
/// sees its previous request's entries.
#[derive(Default)]
pub(super) struct BridgeState {
    /// The runner's latest draft list per slot: reused as the value of
    /// `scheduled_spec_decode_tokens` when it still holds exactly the drafts scheduled.
    drafts: Vec<Option<(u32, Py<PyList>)>>,
    /// `(generation, step number)` of each slot's latest step (the V1 runner gets
    /// `all_token_ids` of a request that was not in the previous step).
    pub(super) last_scheduled: Vec<(u32, u64)>,
    /// Steps built so far.
    pub(super) step_number: u64,
    /// The latest step: drafts in its batch order take the fast path.
    pub(super) last_step: Option<Py<PySchedulerOutput>>,
    /// Python ints handed out as counts, made once each.
    pub(super) ints: IntCache,
    /// The latest `num_scheduled_tokens`, privately kept: a step with the same batch and
    /// counts (a steady decode) hands out a copy of it.
    num_scheduled: Option<NumScheduledTemplate>,
    /// The cumulative counters at the latest stats: prefix-cache lookups (first admissions,
    /// then re-admissions: requests, queries, hits each) and speculative decoding.
    pub(super) prefix_snapshot: [u64; 6],
    pub(super) spec_snapshot: SpecCounters,
}

/// Cumulative speculative-decoding counters: drafts, draft tokens, accepted tokens, accepted
/// and drafted per position.
#[derive(Default, Clone)]
pub(super) struct SpecCounters {
    pub(super) drafts: u64,
    pub(super) draft_tokens: u64,
    pub(super) accepted: u64,
    pub(super) accepted_per_pos: Vec<u64>,
    pub(super) drafted_per_pos: Vec<u64>,
}

/// Python ints `0..len` made once each and shared (ints are immutable): the computed- and
/// output-token counts of a step are then no allocation each.
#[derive(Default)]
pub(super) struct IntCache {
    ints: Vec<Option<Py<PyAny>>>,
}

impl IntCache {
    /// Most ints cached (a pool of larger contexts allocates the counts past it).
    const MAX: usize = 1 << 18;

    pub(super) fn reserve_for(&mut self, max_model_len: usize) {
        let len = (max_model_len + 1).min(Self::MAX);
        if self.ints.len() < len {
            self.ints.resize_with(len, || None);
        }
    }

    /// Prefetches the cached int `v` (if any), which `get` will incref.
    pub(super) fn prefetch(&self, v: usize) {
        if let Some(Some(obj)) = self.ints.get(v) {
            prefetch::read(obj.as_ptr());
        }
    }

    /// The int `v` (cached when `0 <= v < len`).
    pub(super) fn get<'py>(&mut self, py: Python<'py>, v: i64) -> PyResult<Bound<'py, PyAny>> {
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

impl BridgeState {
    /// `num_scheduled_tokens` of a step: a copy of a private one when the batch and the counts
    /// are those of the previous steps (a steady decode), else a new dict. The private copy is
    /// made on the second step of a run of equal steps, so changing batches pay no copy.
    pub(super) fn num_scheduled_tokens<'py>(
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
    pub(super) fn keep_drafts(
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
    pub(super) fn prefetch_drafts(&self, slot: u32) {
        if let Some(Some((_, list))) = self.drafts.get(slot as usize) {
            prefetch::read(list.as_ptr());
        }
    }

    /// The runner's draft list of a slot, or a copy of its first `num_drafts` items: what
    /// vLLM's scheduler hands on too (`request.spec_token_ids`). The core read its tokens when
    /// the runner handed it in; that it still holds at least `num_drafts` is checked here (its
    /// items are not read again: they are the runner's own list).
    pub(super) fn reusable_drafts<'py>(
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
