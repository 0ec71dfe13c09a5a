//! The `Scheduler` Python object and the state behind its lock: the core scheduler, its
//! interned request ids, the step and update buffers it fills, and the tables of the steps it
//! handed out. Its methods live in `scheduler.rs`; the jobs on the state in their own modules.

use std::sync::Arc;

use dflash_core::{CoreError, Scheduler, StepOutput, TableSnapshot, UpdateOutput};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::PyTraverseError;

use crate::allocator;
use crate::errors::{to_py, IntoPyResult};
use crate::guarded::Guarded;
use crate::interned_ids::InternedIds;
use crate::lazy_table::{LazyTable, LazyTables};
use crate::outputs::PySchedulerOutput;

/// Continuous-batching scheduler with DFlash-safe lookahead allocation.
///
/// Safe to share between Python threads: calls are serialised by an internal lock (see
/// [`Guarded`]). A call keeps the GIL while it works: its work is shorter than the wait to take a
/// released GIL back from a busy thread (up to the interpreter's switch interval, 5 ms).
#[pyclass(module = "dflash_rs._core", name = "Scheduler", frozen, weakref)]
pub struct PyScheduler {
    state: Guarded<State>,
    config: Py<PyAny>,
    /// The core configuration's `max_model_len` (sizes a request's vectors before the lock).
    max_model_len: usize,
}

/// The scheduler's mutable state, behind the lock.
pub(crate) struct State {
    pub(crate) inner: Scheduler,
    /// Interned request id per slot, and the last `req_ids` tuple.
    pub(crate) ids: InternedIds,
    /// The step `schedule()` plans into.
    pub(crate) step: StepOutput,
    /// The update `update_from_output*` applies into.
    pub(crate) update: UpdateOutput,
    /// The block tables of the steps handed out.
    pub(crate) tables: LazyTables,
}

impl State {
    /// The state around a new core scheduler.
    fn new(mut inner: Scheduler) -> Self {
        let tables = LazyTables::new(&mut inner);
        Self {
            inner,
            ids: InternedIds::new(),
            step: StepOutput::default(),
            update: UpdateOutput::default(),
            tables,
        }
    }

    /// Drops interned ids of slots whose requests are gone (a scan only when some are).
    pub(crate) fn forget_finished(&mut self) {
        self.ids.forget_finished(&self.inner);
    }

    /// A live request by id.
    pub(crate) fn live(&self, py: Python<'_>, request_id: &str) -> PyResult<&dflash_core::Request> {
        let slot = self
            .inner
            .slot_of(request_id)
            .ok_or_else(|| to_py(py, CoreError::UnknownRequest(request_id.to_owned())))?;
        self.inner.requests().get(slot).py(py)
    }
}

impl PyScheduler {
    /// A scheduler over a new core scheduler built from `core_config`; `config` is the Python
    /// configuration it was read from.
    pub(crate) fn create(
        py: Python<'_>,
        core_config: dflash_core::SchedulerConfig,
        config: Py<PyAny>,
    ) -> PyResult<Self> {
        let max_model_len = core_config.max_model_len;
        let warm = allocator::warm_bytes(core_config.max_num_seqs, max_model_len);
        let inner = Scheduler::new(core_config).py(py)?;
        // After the pool's arrays (written as they are made): the steps' allocations then find
        // their pages faulted in.
        allocator::warm_thread(warm);
        Ok(Self {
            state: Guarded::new(State::new(inner), "Scheduler"),
            config,
            max_model_len,
        })
    }

    /// The Python configuration this scheduler was built from.
    pub(crate) fn config_object(&self) -> &Py<PyAny> {
        &self.config
    }

    /// The core configuration's `max_model_len`.
    pub(crate) fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// Plans one step (`schedule`): `throttle` holds prefills back.
    pub(crate) fn schedule_step(
        slf: &Bound<'_, Self>,
        throttle: bool,
    ) -> PyResult<PySchedulerOutput> {
        slf.get().with_state(slf.py(), |st| {
            let (inner, step) = (&mut st.inner, &mut st.step);
            inner.schedule_throttled(step, throttle).py(slf.py())?;
            st.build_output(slf)
        })
    }

    /// Runs `f` on the scheduler's state, holding it.
    pub(crate) fn with_state<R>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut State) -> PyResult<R>,
    ) -> PyResult<R> {
        self.state.with(py, f)
    }

    /// Freezes a step's table (see [`LazyTables::freeze`]): called when it is first read.
    pub(crate) fn freeze_table(
        &self,
        py: Python<'_>,
        lazy: &LazyTable,
    ) -> PyResult<Arc<TableSnapshot>> {
        self.state
            .with(py, |st| st.tables.freeze(py, &st.inner, lazy))
    }

    /// Garbage-collector support: the config and the Python objects the state holds. Skips the
    /// state while a call holds it (the collector then sees fewer references, which can only
    /// keep objects alive, never free one in use). No `__clear__`: the config is immutable
    /// here, so a cycle through it is broken where it is mutable (the config's attributes); the
    /// state holds only strs and tuples of strs, which can close no cycle.
    pub(crate) fn traverse(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.config)?;
        self.state
            .try_peek(|st| st.ids.traverse(&visit))
            .unwrap_or(Ok(()))
    }
}
