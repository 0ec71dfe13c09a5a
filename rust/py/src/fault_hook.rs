//! `_inject_fault`: the Python tests' handle on the core's fault points (test-only, built with
//! the `fault-injection` feature).

use dflash_core::fault::{arm, disarm, FaultKind};
use pyo3::prelude::*;

use crate::errors::{invalid, IntoPyResult};

/// Arms a core fault point to fail once: `kind` is "error" (an internal error) or "panic".
/// Test-only: present when built with the `fault-injection` feature (`make develop`).
#[pyfunction]
#[pyo3(name = "_inject_fault", signature = (point, kind="error"))]
pub(crate) fn inject_fault(py: Python<'_>, point: &str, kind: &str) -> PyResult<()> {
    let kind = match kind {
        "error" => FaultKind::Error,
        "panic" => FaultKind::Panic,
        "off" => {
            disarm();
            return Ok(());
        }
        other => {
            return Err(invalid(
                py,
                format!("fault kind must be \"error\", \"panic\" or \"off\", got {other:?}"),
            ))
        }
    };
    arm(point, kind).py(py)
}
