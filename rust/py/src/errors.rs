//! Maps core errors onto the Python exception classes of `dflash_rs.errors`.
//!
//! The classes are resolved once, when the module is imported ([`resolve_classes`]): a class
//! renamed or moved in `dflash_rs/errors.py` fails the import with its name instead of turning
//! every later error into a `RuntimeError`.

use dflash_core::CoreError;
use pyo3::exceptions::{PyException, PyImportError, PyMemoryError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// The `dflash_rs.errors` classes the bindings raise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorClass {
    InvalidArgument,
    ArgumentType,
    UnknownRequest,
    DuplicateRequest,
    PromptTooLong,
    OutOfBlocks,
    SchedulerState,
    Invariant,
}

impl ErrorClass {
    /// Every class, in the order of their slots in [`CLASSES`].
    pub const ALL: [ErrorClass; 8] = [
        ErrorClass::InvalidArgument,
        ErrorClass::ArgumentType,
        ErrorClass::UnknownRequest,
        ErrorClass::DuplicateRequest,
        ErrorClass::PromptTooLong,
        ErrorClass::OutOfBlocks,
        ErrorClass::SchedulerState,
        ErrorClass::Invariant,
    ];

    /// The class's name in `dflash_rs.errors`.
    pub const fn name(self) -> &'static str {
        match self {
            ErrorClass::InvalidArgument => "InvalidArgumentError",
            ErrorClass::ArgumentType => "ArgumentTypeError",
            ErrorClass::UnknownRequest => "UnknownRequestError",
            ErrorClass::DuplicateRequest => "DuplicateRequestError",
            ErrorClass::PromptTooLong => "PromptTooLongError",
            ErrorClass::OutOfBlocks => "OutOfBlocksError",
            ErrorClass::SchedulerState => "SchedulerStateError",
            ErrorClass::Invariant => "InvariantError",
        }
    }

    /// The class a core error raises.
    pub const fn of(err: &CoreError) -> ErrorClass {
        match err {
            CoreError::InvalidArgument(_) => ErrorClass::InvalidArgument,
            CoreError::UnknownRequest(_) => ErrorClass::UnknownRequest,
            CoreError::DuplicateRequest(_) => ErrorClass::DuplicateRequest,
            CoreError::TooLong(_) => ErrorClass::PromptTooLong,
            CoreError::OutOfBlocks(_) => ErrorClass::OutOfBlocks,
            CoreError::State(_) => ErrorClass::SchedulerState,
            CoreError::Invariant(_) => ErrorClass::Invariant,
        }
    }
}

/// The resolved classes, indexed by `ErrorClass as usize`.
static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

/// Resolves every [`ErrorClass`] in `dflash_rs.errors`, each a subclass of `DFlashRsError`;
/// an `ImportError` naming the first one missing. Called by the module's init.
pub fn resolve_classes(py: Python<'_>) -> PyResult<()> {
    CLASSES.get_or_try_init(py, || {
        let module = py.import("dflash_rs.errors")?;
        let class = |name: &str| -> PyResult<Bound<'_, PyType>> {
            module
                .getattr(name)
                .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from))
                .map_err(|e| {
                    PyImportError::new_err(format!(
                        "dflash_rs._core: dflash_rs.errors.{name} is missing or not a class ({e})"
                    ))
                })
        };
        let base = class("DFlashRsError")?;
        ErrorClass::ALL
            .iter()
            .map(|c| {
                let ty = class(c.name())?;
                if !ty.is_subclass(&base)? {
                    return Err(PyImportError::new_err(format!(
                        "dflash_rs._core: dflash_rs.errors.{} is not a DFlashRsError",
                        c.name()
                    )));
                }
                Ok(ty.unbind())
            })
            .collect()
    })?;
    Ok(())
}

/// Raises `dflash_rs.errors.<class>(message)`.
pub fn py_error(py: Python<'_>, class: ErrorClass, message: String) -> PyErr {
    match CLASSES.get(py) {
        Some(classes) => PyErr::from_type(classes[class as usize].bind(py).clone(), (message,)),
        // Unreachable: the module's init resolved them or the import failed.
        None => PyRuntimeError::new_err(format!("{message} (dflash_rs.errors is not resolved)")),
    }
}

/// Converts a core error into the matching Python exception.
pub fn to_py(py: Python<'_>, err: CoreError) -> PyErr {
    py_error(py, ErrorClass::of(&err), err.to_string())
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
    py_error(py, ErrorClass::InvalidArgument, message.into())
}

/// An `ArgumentTypeError` (an `InvalidArgumentError` that is also a `TypeError`): an argument
/// of the wrong type.
pub fn wrong_type(py: Python<'_>, message: impl Into<String>) -> PyErr {
    py_error(py, ErrorClass::ArgumentType, message.into())
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
