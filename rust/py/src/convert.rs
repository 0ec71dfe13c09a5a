//! Argument conversion with clear errors: token id sequences and non-negative counts.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList};
use std::fmt::Display;

use crate::errors::{invalid, unless_fatal};

/// Largest token id accepted (token ids are int32 on the GPU side).
pub const MAX_TOKEN_ID: i64 = i32::MAX as i64;

fn check_token(py: Python<'_>, what: impl Display, i: usize, t: i64) -> PyResult<u32> {
    if (0..=MAX_TOKEN_ID).contains(&t) {
        Ok(t as u32)
    } else {
        Err(invalid(
            py,
            format!("{what}[{i}] = {t} is outside [0, 2**31 - 1]"),
        ))
    }
}

/// Converts checked token values; the fast path is one vectorisable pass over a slice.
fn tokens_from_slice<T: Copy + Into<i64>>(
    py: Python<'_>,
    what: impl Display,
    values: &[T],
    capacity: impl Fn(usize) -> usize,
) -> PyResult<Vec<u32>> {
    let in_range = |t: &T| (0..=MAX_TOKEN_ID).contains(&(*t).into());
    // A fold without early exit: `all` stops at the first failure, which keeps it scalar.
    if values.iter().fold(true, |ok, t| ok & in_range(t)) {
        let mut tokens = Vec::with_capacity(capacity(values.len()));
        tokens.extend(values.iter().map(|&t| t.into() as u32));
        return Ok(tokens);
    }
    let (i, &bad) = values
        .iter()
        .enumerate()
        .find(|(_, t)| !in_range(t))
        .expect("a value is out of range");
    Err(check_token(py, what, i, bad.into()).unwrap_err())
}

/// Extracts token ids from a list/tuple of ints or a 1-D int32/int64 numpy array. `what` names
/// the argument in error messages; it is only formatted on an error (pass `format_args!`).
pub fn token_ids(obj: &Bound<'_, PyAny>, what: impl Display + Copy) -> PyResult<Vec<u32>> {
    token_ids_with_capacity(obj, what, |len| len)
}

/// [`token_ids`] into a vector of `capacity(len)` elements (at least `len`), for a vector
/// that will grow.
pub fn token_ids_with_capacity(
    obj: &Bound<'_, PyAny>,
    what: impl Display + Copy,
    capacity: impl Fn(usize) -> usize,
) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(list) = obj.cast::<PyList>() {
        // The common case from Python (one list per request): no numpy type checks first.
        let mut values = Vec::with_capacity(capacity(list.len()));
        for item in list.iter() {
            let t: i64 = item
                .extract()
                .map_err(|e| unless_fatal(py, e, || not_a_sequence(py, what)))?;
            values.push(check_token(py, what, values.len(), t)?);
        }
        return Ok(values);
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return match arr.as_slice() {
            Ok(slice) => tokens_from_slice(py, what, slice, &capacity),
            Err(_) => tokens_from_slice(py, what, &arr.as_array().to_vec(), &capacity),
        };
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return match arr.as_slice() {
            Ok(slice) => tokens_from_slice(py, what, slice, &capacity),
            Err(_) => tokens_from_slice(py, what, &arr.as_array().to_vec(), &capacity),
        };
    }
    if let Ok(arr) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(invalid(
            py,
            format!(
                "{what} must be a 1-D int32 or int64 array, got ndim={} dtype={}",
                arr.ndim(),
                arr.dtype()
            ),
        ));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(invalid(
            py,
            format!("{what} must be a sequence of ints, not a string"),
        ));
    }
    let values: Vec<i64> = obj
        .extract()
        .map_err(|e| unless_fatal(py, e, || not_a_sequence(py, what)))?;
    values
        .iter()
        .enumerate()
        .map(|(i, &t)| check_token(py, what, i, t))
        .collect()
}

/// A Python int argument (a count, a length, a block id). Unlike a plain `i64` it rejects
/// `bool` and reports values beyond 64 bits as `InvalidArgumentError` rather than the builtin
/// `OverflowError`, so every bad number raises the same typed error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int(pub i64);

impl<'a, 'py> FromPyObject<'a, 'py> for Int {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        int_named(&obj, "an int argument").map(Int)
    }
}

fn not_a_sequence(py: Python<'_>, what: impl Display) -> PyErr {
    invalid(
        py,
        format!("{what} must be a sequence of ints or a 1-D integer array"),
    )
}

/// Extracts a Python int named `what` for messages (see [`Int`]).
pub fn int_named(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    let py = obj.py();
    if obj.is_instance_of::<PyBool>() {
        return Err(invalid(
            py,
            format!("{what} must be an int, got the bool {obj}"),
        ));
    }
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => Err(invalid(
            py,
            format!("{what} = {obj} is out of range: integers must lie in [-2**63, 2**63 - 1]"),
        )),
        Err(e) => Err(e),
    }
}

impl From<Int> for i64 {
    fn from(v: Int) -> i64 {
        v.0
    }
}

/// A count that must be >= 0.
pub fn non_negative(py: Python<'_>, what: &str, value: impl Into<i64>) -> PyResult<usize> {
    let value: i64 = value.into();
    usize::try_from(value).map_err(|_| invalid(py, format!("{what} must be >= 0, got {value}")))
}

/// A count that must be >= 1.
pub fn positive(py: Python<'_>, what: &str, value: impl Into<i64>) -> PyResult<usize> {
    let value: i64 = value.into();
    match usize::try_from(value) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(invalid(py, format!("{what} must be >= 1, got {value}"))),
    }
}

/// A flag that must be a Python bool (not an int or any other truthy object).
pub fn strict_bool(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<bool> {
    match obj.cast::<PyBool>() {
        Ok(b) => Ok(b.is_true()),
        Err(_) => {
            let type_name = obj
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".to_owned());
            Err(invalid(
                obj.py(),
                format!("{what} must be a bool, got {type_name}"),
            ))
        }
    }
}

/// A request id: a non-empty string.
pub fn request_id(py: Python<'_>, id: &str) -> PyResult<()> {
    if id.is_empty() {
        return Err(invalid(py, "request_id must be a non-empty string"));
    }
    Ok(())
}
