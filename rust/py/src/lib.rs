//! `dflash_rs._core`: thin PyO3 bindings over `dflash-core`. This crate only converts types,
//! maps errors and releases the GIL; all logic lives in the core.

mod convert;
mod draft_dict;
mod draft_install;
mod errors;
mod fast_call;
#[cfg(feature = "fault-injection")]
mod fault_hook;
mod guarded;
mod hash_config;
mod interned_ids;
mod kv_cache_manager;
mod lazy_table;
mod outputs;
mod runner_output;
mod scheduler;
mod scheduler_args;
mod step_output;
mod step_update;
mod vllm_bridge;

use pyo3::prelude::*;

/// mimalloc for every Rust allocation of the extension (Python's own objects keep Python's
/// allocator). A step walks each running request's token, hash and block vectors; mimalloc
/// packs such vectors of one size class together in arenas it backs with transparent huge
/// pages, so the walk touches far fewer pages (and TLB entries) than with glibc's malloc
/// (measured when it was introduced; see the history of docs/BENCHMARKS.md).
/// `local_dynamic_tls` because the module is loaded with `dlopen`.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The native module behind the `dflash_rs` package.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::resolve_classes(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<kv_cache_manager::PyKvCacheManager>()?;
    m.add_class::<scheduler::PyScheduler>()?;
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
