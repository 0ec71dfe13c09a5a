//! Maps core errors onto the Python exception classes of `dflash_rs.errors`.

use dflash_core::CoreError;
use pyo3::exceptions::{PyException, PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::PyType;

/// Raises `dflash_rs.errors.<class_name>(message)`.
pub fn py_error(py: Python<'_>, class_name: &str, message: String) -> PyErr {
    let class = py
        .import("dflash_rs.errors")
        .and_then(|m| m.getattr(class_name))
        .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
    match class {
        Ok(class) => PyErr::from_type(class, (message,)),
        Err(e) => PyRuntimeError::new_err(format!("{message} (and dflash_rs.errors failed: {e})")),
    }
}

/// Converts a core error into the matching Python exception.
pub fn to_py(py: Python<'_>, err: CoreError) -> PyErr {
    let class = match &err {
        CoreError::InvalidArgument(_) => "InvalidArgumentError",
        CoreError::UnknownRequest(_) => "UnknownRequestError",
        CoreError::DuplicateRequest(_) => "DuplicateRequestError",
        CoreError::TooLong(_) => "PromptTooLongError",
        CoreError::OutOfBlocks(_) => "OutOfBlocksError",
        CoreError::State(_) => "SchedulerStateError",
        CoreError::Invariant(_) => "InvariantError",
    };
    py_error(py, class, err.to_string())
}

/// `?`-friendly conversion of a core result.
pub trait IntoPyResult<T> {
    /// The core result as a `PyResult`.
    fn py(self, py: Python<'_>) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for Result<T, CoreError> {
    fn py(self, py: Python<'_>) -> PyResult<T> {
        self.map_err(|e| to_py(py, e))
    }
}

/// An `InvalidArgumentError` with the given message.
pub fn invalid(py: Python<'_>, message: impl Into<String>) -> PyErr {
    py_error(py, "InvalidArgumentError", message.into())
}

/// An `ArgumentTypeError` (an `InvalidArgumentError` that is also a `TypeError`): an argument
/// of the wrong type.
pub fn wrong_type(py: Python<'_>, message: impl Into<String>) -> PyErr {
    py_error(py, "ArgumentTypeError", message.into())
}

/// The name of `obj`'s type, for messages ("int", "NoneType", "numpy.bool").
pub fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

/// `err` itself where it must reach the caller unchanged, else `typed()` with `err` as its
/// `__cause__`: a conversion that failed because Python raised `KeyboardInterrupt`,
/// `SystemExit` (any `BaseException` that is not an `Exception`) or `MemoryError` re-raises it
/// instead of reporting a bad argument.
pub fn unless_fatal(py: Python<'_>, err: PyErr, typed: impl FnOnce() -> PyErr) -> PyErr {
    if !err.is_instance_of::<PyException>(py) || err.is_instance_of::<PyMemoryError>(py) {
        err
    } else {
        let typed = typed();
        typed.set_cause(py, Some(err));
        typed
    }
}
