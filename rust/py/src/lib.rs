//! `dflash_rs._core`: thin PyO3 bindings over `dflash-core`. This crate only converts types,
//! maps errors and releases the GIL; all logic lives in the core.

mod convert;
mod errors;
mod guarded;
mod hash_config;
mod kv_cache_manager;
mod outputs;
mod scheduler;
mod scheduler_args;

use pyo3::prelude::*;

/// The native module behind the `dflash_rs` package.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<kv_cache_manager::PyKvCacheManager>()?;
    m.add_class::<scheduler::PyScheduler>()?;
    m.add_class::<outputs::PySchedulerOutput>()?;
    m.add_class::<outputs::PyNewRequestData>()?;
    m.add_class::<outputs::PyCachedRequestData>()?;
    m.add_class::<outputs::PyRequestOutput>()?;
    m.add_class::<outputs::PyUpdateResult>()?;
    // Test-only and private: set as an attribute so it stays out of `__all__`.
    #[cfg(feature = "fault-injection")]
    m.setattr(
        "_inject_fault",
        wrap_pyfunction!(scheduler::inject_fault, m)?,
    )?;
    Ok(())
}
