//! `dflash_rs._core`: thin PyO3 bindings over `dflash-core`. This crate only converts types,
//! maps errors and serialises threads; all logic lives in the core.
//!
//! Modules, bottom-up (each uses only those above it):
//! - `allocator`: the global allocator (mimalloc) and the warm reserve the steps use.
//! - `errors`: core errors mapped onto the exception classes of `dflash_rs.errors`.
//! - `dataclass_build`: plain dataclass instances built by setting their fields.
//! - `refcount`: reference counts changed in place, for the bridge's per-request loops.
//! - `untracked`: lists, tuples and objects of atomic items kept out of the cyclic GC.
//! - `named_fields`: a class's field names, and its constructor called with them.
//! - `struct_slots`: msgspec `Struct` instances built by filling their field slots.
//! - `guarded`: the lock around a pyclass's mutable state (threads, re-entry, panics).
//! - `seq_items`: the items of exact lists and tuples as a slice.
//! - `compact_int`: the value of a small exact int without a call.
//! - `convert`: argument conversion with clear errors (token ids, ints, bools, strs).
//! - `hash_config`: the block hasher from the `hash_algo` / `hash_seed` arguments.
//! - `scheduler_args`: the Python `SchedulerConfig` and `Request` objects read into core types.
//! - `draft_dict`: reading the argument of `update_draft_token_ids`.
//! - `kv_cache_manager`: `dflash_rs.KVCacheManager`.
//! - `interned_ids`: request ids interned once per request, and the shared `req_ids` tuple.
//! - `lazy_table`: the steps' block tables, frozen when first read; the journal's upkeep.
//! - `scheduler_state`: the `Scheduler` object and the state behind its lock.
//! - `outputs`: the Python views of a step (`SchedulerOutput`, `RequestOutput`, ...).
//! - `runner_output`: reading the model runner's output for a step.
//! - `step_output`: assembling the `SchedulerOutput` a step hands out.
//! - `step_update`: applying a step's output and building the per-request results.
//! - `draft_install`: installing a drafts dict in the scheduler.
//! - `scheduler`: `dflash_rs.Scheduler`'s methods.
//! - `vllm_bridge`: `_VllmBridge`, the vLLM drop-in's per-step objects in one pass.
//! - `fault_hook`: `_inject_fault`, test-only (feature `fault-injection`).

mod allocator;
mod compact_int;
mod convert;
mod dataclass_build;
mod draft_dict;
mod draft_install;
mod errors;
#[cfg(feature = "fault-injection")]
mod fault_hook;
mod guarded;
mod hash_config;
mod interned_ids;
mod kv_cache_manager;
mod lazy_table;
mod named_fields;
mod outputs;
mod refcount;
mod runner_output;
mod scheduler;
mod scheduler_args;
mod scheduler_state;
mod seq_items;
mod step_output;
mod step_update;
mod struct_slots;
mod untracked;
mod vllm_bridge;

use pyo3::prelude::*;

/// The native module behind the `dflash_rs` package.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    allocator::keep_freed_memory();
    errors::resolve_classes(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<kv_cache_manager::PyKvCacheManager>()?;
    m.add_class::<scheduler_state::PyScheduler>()?;
    m.add_class::<outputs::PySchedulerOutput>()?;
    m.add_class::<outputs::PyNewRequestData>()?;
    m.add_class::<outputs::PyCachedRequestData>()?;
    m.add_class::<outputs::PyRequestOutput>()?;
    m.add_class::<outputs::PyUpdateResult>()?;
    // Private: the config classes of the Python package validate themselves through these.
    m.setattr(
        "_check_scheduler_config",
        wrap_pyfunction!(scheduler_args::check_scheduler_config, m)?,
    )?;
    m.setattr(
        "_check_request",
        wrap_pyfunction!(scheduler_args::check_request, m)?,
    )?;
    m.setattr(
        "_check_speculative_config",
        wrap_pyfunction!(scheduler_args::check_speculative_config, m)?,
    )?;
    // Private, for tests: which layout-dependent fast paths this interpreter allows.
    m.setattr("_fast_paths", wrap_pyfunction!(fast_paths, m)?)?;
    // Private to `dflash_rs.vllm`: set as an attribute so it stays out of `__all__`.
    m.setattr(
        "_VllmBridge",
        m.py().get_type::<vllm_bridge::PyVllmBridge>(),
    )?;
    // Test-only and private: set as an attribute so it stays out of `__all__`.
    #[cfg(feature = "fault-injection")]
    m.setattr(
        "_inject_fault",
        wrap_pyfunction!(fault_hook::inject_fault, m)?,
    )?;
    Ok(())
}

/// Which fast paths that read CPython's object layout this interpreter passed the checks of:
/// `(int encoding name or None, whether list and tuple items are read in place)`.
#[pyfunction]
fn fast_paths(py: Python<'_>) -> (Option<&'static str>, bool) {
    (
        compact_int::encoding(py).map(compact_int::Encoding::name),
        seq_items::layout_holds(py),
    )
}
