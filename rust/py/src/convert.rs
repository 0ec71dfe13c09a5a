//! Argument conversion with clear errors: token id sequences and non-negative counts.

use numpy::{PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid;

/// Largest token id accepted (token ids are int32 on the GPU side).
pub const MAX_TOKEN_ID: i64 = i32::MAX as i64;

fn check_token(py: Python<'_>, what: &str, i: usize, t: i64) -> PyResult<u32> {
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
    what: &str,
    values: &[T],
) -> PyResult<Vec<u32>> {
    let in_range = |t: &T| (0..=MAX_TOKEN_ID).contains(&(*t).into());
    if values.iter().all(in_range) {
        return Ok(values.iter().map(|&t| t.into() as u32).collect());
    }
    let (i, &bad) = values
        .iter()
        .enumerate()
        .find(|(_, t)| !in_range(t))
        .expect("a value is out of range");
    Err(check_token(py, what, i, bad.into()).unwrap_err())
}

/// Extracts token ids from a list/tuple of ints or a 1-D int32/int64 numpy array.
pub fn token_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let py = obj.py();
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i32>>() {
        return match arr.as_slice() {
            Ok(slice) => tokens_from_slice(py, what, slice),
            Err(_) => tokens_from_slice(py, what, &arr.as_array().to_vec()),
        };
    }
    if let Ok(arr) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return match arr.as_slice() {
            Ok(slice) => tokens_from_slice(py, what, slice),
            Err(_) => tokens_from_slice(py, what, &arr.as_array().to_vec()),
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
    let values: Vec<i64> = obj.extract().map_err(|_| {
        invalid(
            py,
            format!("{what} must be a sequence of ints or a 1-D integer array"),
        )
    })?;
    values
        .iter()
        .enumerate()
        .map(|(i, &t)| check_token(py, what, i, t))
        .collect()
}

/// A count that must be >= 0.
pub fn non_negative(py: Python<'_>, what: &str, value: i64) -> PyResult<usize> {
    usize::try_from(value).map_err(|_| invalid(py, format!("{what} must be >= 0, got {value}")))
}

/// A count that must be >= 1.
pub fn positive(py: Python<'_>, what: &str, value: i64) -> PyResult<usize> {
    match usize::try_from(value) {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(invalid(py, format!("{what} must be >= 1, got {value}"))),
    }
}

/// A request id: a non-empty string.
pub fn request_id(py: Python<'_>, id: &str) -> PyResult<()> {
    if id.is_empty() {
        return Err(invalid(py, "request_id must be a non-empty string"));
    }
    Ok(())
}
