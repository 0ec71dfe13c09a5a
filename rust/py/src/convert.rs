//! Argument conversion with clear errors: token id sequences, ints, bools and strs.
//!
//! A value of the wrong type raises `ArgumentTypeError` (an `InvalidArgumentError` that is also
//! a `TypeError`); a value of the right type but out of range raises `InvalidArgumentError`.
//! Anything with `__index__` (a numpy integer scalar) counts as an int, except `bool` and
//! `numpy.bool_`.

use std::borrow::Cow;
use std::fmt::Display;
use std::ops::Deref;

use numpy::{
    Element, PyArrayDescrMethods, PyReadonlyArray1, PyUntypedArray, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PyString, PyTuple};

use crate::compact_int;
use crate::errors::{invalid, type_name, unless_fatal, wrong_type};
use crate::seq_items::with_exact_items;

/// Largest token id accepted (token ids are int32 on the GPU side).
pub const MAX_TOKEN_ID: i64 = i32::MAX as i64;

#[cold]
fn token_out_of_range(py: Python<'_>, what: impl Display, i: usize, t: impl Display) -> PyErr {
    invalid(py, format!("{what}[{i}] = {t} is outside [0, 2**31 - 1]"))
}

fn check_token(py: Python<'_>, what: impl Display, i: usize, t: i64) -> PyResult<u32> {
    if (0..=MAX_TOKEN_ID).contains(&t) {
        Ok(t as u32)
    } else {
        Err(token_out_of_range(py, what, i, t))
    }
}

/// An element type of a numpy integer array that token ids are read from.
trait TokenValue: Element + Copy + Display {
    fn is_token(self) -> bool;
    /// The value as a token id; only called on values for which `is_token` holds.
    fn to_token(self) -> u32;
}

macro_rules! token_value_up_to_64_bits {
    ($($t:ty),*) => {$(
        impl TokenValue for $t {
            #[inline]
            fn is_token(self) -> bool {
                (0..=MAX_TOKEN_ID).contains(&i64::from(self))
            }
            #[inline]
            fn to_token(self) -> u32 {
                i64::from(self) as u32
            }
        }
    )*};
}
token_value_up_to_64_bits!(i8, i16, i32, i64, u8, u16, u32);

impl TokenValue for u64 {
    #[inline]
    fn is_token(self) -> bool {
        self <= MAX_TOKEN_ID as u64
    }
    #[inline]
    fn to_token(self) -> u32 {
        self as u32
    }
}

/// Converts checked token values; the fast path is one vectorisable pass over a slice.
fn tokens_from_slice<T: TokenValue>(
    py: Python<'_>,
    what: impl Display,
    values: &[T],
    capacity: impl Fn(usize) -> usize,
) -> PyResult<Vec<u32>> {
    // A fold without early exit: `all` stops at the first failure, which keeps it scalar.
    if values.iter().fold(true, |ok, t| ok & t.is_token()) {
        let mut tokens = Vec::with_capacity(capacity(values.len()));
        tokens.extend(values.iter().map(|&t| t.to_token()));
        return Ok(tokens);
    }
    let (i, &bad) = values
        .iter()
        .enumerate()
        .find(|(_, t)| !t.is_token())
        .expect("a value is out of range");
    Err(token_out_of_range(py, what, i, bad))
}

/// Tokens of a 1-D array of element type `T`, or None when `arr` holds another type (or is
/// not 1-D, or not in native byte order).
fn tokens_from_array<T: TokenValue>(
    arr: &Bound<'_, PyUntypedArray>,
    what: impl Display,
    capacity: impl Fn(usize) -> usize,
) -> Option<PyResult<Vec<u32>>> {
    let arr = arr.extract::<PyReadonlyArray1<'_, T>>().ok()?;
    let py = arr.py();
    Some(match arr.as_slice() {
        Ok(slice) => tokens_from_slice(py, what, slice, capacity),
        Err(_) => tokens_from_slice(py, what, &arr.as_array().to_vec(), capacity),
    })
}

/// Extracts token ids from a list/tuple of ints or a 1-D numpy integer array. `what` names
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
            values.push(token_item(what, values.len(), &item)?);
        }
        return Ok(values);
    }
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        return tokens_from_any_array(arr, what, capacity);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        let mut values = Vec::with_capacity(capacity(tuple.len()));
        for item in tuple.iter() {
            values.push(token_item(what, values.len(), &item)?);
        }
        return Ok(values);
    }
    if obj.is_instance_of::<PyString>() || obj.is_instance_of::<PyBytes>() {
        return Err(wrong_type(
            py,
            format!("{what} must be a sequence of ints, not a string"),
        ));
    }
    // Any other sequence; its items are read as from a list.
    let items: Vec<Bound<'_, PyAny>> = obj
        .extract()
        .map_err(|e| unless_fatal(py, e, || not_a_sequence(py, what, obj)))?;
    let mut values = Vec::with_capacity(capacity(items.len()));
    for item in &items {
        values.push(token_item(what, values.len(), item)?);
    }
    Ok(values)
}

/// The int32 and int64 arrays engines pass are read in place; the other integer dtypes too,
/// through the same checked pass.
fn tokens_from_any_array(
    arr: &Bound<'_, PyUntypedArray>,
    what: impl Display + Copy,
    capacity: impl Fn(usize) -> usize,
) -> PyResult<Vec<u32>> {
    let cap = &capacity;
    tokens_from_array::<i32>(arr, what, cap)
        .or_else(|| tokens_from_array::<i64>(arr, what, cap))
        .or_else(|| tokens_from_array::<u32>(arr, what, cap))
        .or_else(|| tokens_from_array::<u64>(arr, what, cap))
        .or_else(|| tokens_from_array::<i16>(arr, what, cap))
        .or_else(|| tokens_from_array::<u16>(arr, what, cap))
        .or_else(|| tokens_from_array::<i8>(arr, what, cap))
        .or_else(|| tokens_from_array::<u8>(arr, what, cap))
        .unwrap_or_else(|| Err(not_a_token_array(arr, what)))
}

#[cold]
fn not_a_token_array(arr: &Bound<'_, PyUntypedArray>, what: impl Display) -> PyErr {
    let py = arr.py();
    let dtype = arr.dtype();
    let (ndim, kind) = (arr.ndim(), dtype.kind());
    if kind != b'i' && kind != b'u' {
        wrong_type(
            py,
            format!("{what} must be a 1-D integer array, got ndim={ndim} dtype={dtype}"),
        )
    } else if ndim != 1 {
        invalid(
            py,
            format!("{what} must be a 1-D integer array, got ndim={ndim} dtype={dtype}"),
        )
    } else {
        // Read as is, a big-endian 256 would be 65536.
        invalid(
            py,
            format!("{what} must be an integer array in native byte order, got dtype={dtype}"),
        )
    }
}

/// One token of a list or tuple: the fast path is an exact `int` (never a `bool`).
#[inline]
fn token_item(what: impl Display, i: usize, item: &Bound<'_, PyAny>) -> PyResult<u32> {
    if item.is_exact_instance_of::<PyInt>() {
        if let Ok(t) = item.extract::<i64>() {
            return check_token(item.py(), what, i, t);
        }
    }
    token_item_slow(what, i, item)
}

/// A token that is not a 64-bit exact `int`: a numpy integer, an int subclass, a huge int, or
/// something that is no int at all.
#[cold]
fn token_item_slow(what: impl Display, i: usize, item: &Bound<'_, PyAny>) -> PyResult<u32> {
    let py = item.py();
    if is_bool(item) {
        return Err(wrong_type(
            py,
            format!("{what}[{i}] must be an int, got the bool {item}"),
        ));
    }
    match item.extract::<i64>() {
        Ok(t) => check_token(py, what, i, t),
        Err(e) if e.is_instance_of::<PyOverflowError>(py) => {
            Err(token_out_of_range(py, what, i, item))
        }
        Err(e) => Err(unless_fatal(py, e, || {
            wrong_type(
                py,
                format!(
                    "{what} must be a sequence of ints or a 1-D integer array; \
                     {what}[{i}] is a {}",
                    type_name(item)
                ),
            )
        })),
    }
}

#[cold]
fn not_a_sequence(py: Python<'_>, what: impl Display, obj: &Bound<'_, PyAny>) -> PyErr {
    wrong_type(
        py,
        format!(
            "{what} must be a sequence of ints or a 1-D integer array, got {}",
            type_name(obj)
        ),
    )
}

/// Whether `obj` is a `bool` or a `numpy.bool_` (which an int argument refuses).
fn is_bool(obj: &Bound<'_, PyAny>) -> bool {
    obj.is_instance_of::<PyBool>()
        || (!obj.is_instance_of::<PyInt>()
            && obj.get_type().is(numpy::dtype::<bool>(obj.py()).typeobj()))
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

impl From<Int> for i64 {
    fn from(v: Int) -> i64 {
        v.0
    }
}

/// Extracts a Python int (or anything with `__index__` but a bool) named `what` for messages
/// (see [`Int`]).
pub fn int_named(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    if obj.is_exact_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(v);
        }
    }
    int_named_slow(obj, what)
}

#[cold]
fn int_named_slow(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<i64> {
    let py = obj.py();
    if is_bool(obj) {
        return Err(wrong_type(
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
        Err(e) => Err(unless_fatal(py, e, || {
            wrong_type(py, format!("{what} must be an int, got {}", type_name(obj)))
        })),
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
        Err(_) => Err(wrong_type(
            obj.py(),
            format!("{what} must be a bool, got {}", type_name(obj)),
        )),
    }
}

/// A bool argument (see [`strict_bool`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag(pub bool);

impl<'a, 'py> FromPyObject<'a, 'py> for Flag {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        strict_bool(&obj, "a bool argument").map(Flag)
    }
}

/// A `str` named `what` for messages.
pub fn str_named<'a>(obj: Borrowed<'a, '_, PyAny>, what: &str) -> PyResult<Cow<'a, str>> {
    obj.extract::<Cow<'a, str>>()
        .map_err(|e| not_a_str(&obj, what, e))
}

#[cold]
fn not_a_str(obj: &Bound<'_, PyAny>, what: &str, err: PyErr) -> PyErr {
    let py = obj.py();
    if obj.is_instance_of::<PyString>() {
        unless_fatal(py, err, || {
            invalid(
                py,
                format!("{what} is not valid text (it holds a lone surrogate)"),
            )
        })
    } else {
        wrong_type(py, format!("{what} must be a str, got {}", type_name(obj)))
    }
}

/// An optional `str` named `what` (None stays None).
pub fn opt_str_named(obj: Option<&Bound<'_, PyAny>>, what: &str) -> PyResult<Option<String>> {
    match obj {
        Some(obj) if !obj.is_none() => Ok(Some(str_named(obj.as_borrowed(), what)?.into_owned())),
        _ => Ok(None),
    }
}

/// A `str` argument (a name or a status).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text<'a>(pub Cow<'a, str>);

impl<'a, 'py> FromPyObject<'a, 'py> for Text<'a> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        str_named(obj, "a str argument").map(Text)
    }
}

impl Deref for Text<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// A request id argument: a `str`.
pub struct RequestId<'a>(Cow<'a, str>);

impl<'a, 'py> FromPyObject<'a, 'py> for RequestId<'a> {
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        str_named(obj, "request_id").map(RequestId)
    }
}

impl Deref for RequestId<'_> {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

/// A request id: a non-empty string.
pub fn request_id(py: Python<'_>, id: &str) -> PyResult<()> {
    if id.is_empty() {
        return Err(invalid(py, "request_id must be a non-empty string"));
    }
    Ok(())
}

/// Appends the tokens of `obj` when it is an exact `list` or `tuple` of exact `int`s that are
/// all token ids, and returns whether it did. This is the common case from Python (one list
/// per request), read without a Python call or a reference count; for anything else it
/// returns false with `tokens` as it was, and the caller takes the general path
/// ([`token_ids`]), which raises the precise error.
pub fn push_exact_token_ids(obj: Borrowed<'_, '_, PyAny>, tokens: &mut Vec<u32>) -> bool {
    let before = tokens.len();
    // SAFETY: `obj` is alive, and nothing here runs Python code (reading an exact int calls
    // no `__index__`, and no Python object is allocated, so no garbage collection runs
    // either), so no item can be replaced or freed while its borrowed pointer is read.
    let ok = unsafe { push_exact_seq(obj.as_ptr(), tokens) };
    if !ok {
        tokens.truncate(before);
    }
    ok
}

/// Flattens a sequence of token sequences (`sampled_token_ids`, `draft_token_ids`) into
/// `tokens` and one count per sequence, when it is an exact `list` or `tuple` of items that
/// [`push_exact_token_ids`] reads; returns false with both vectors cleared otherwise.
pub fn flat_exact_token_lists(
    obj: &Bound<'_, PyAny>,
    tokens: &mut Vec<u32>,
    counts: &mut Vec<u32>,
) -> bool {
    // SAFETY: as in `push_exact_token_ids`.
    let ok = unsafe {
        for_each_exact_item(obj.as_ptr(), |seq| {
            let before = tokens.len();
            let ok = push_exact_seq(seq, tokens);
            counts.push((tokens.len() - before) as u32);
            ok
        })
    };
    if !ok {
        tokens.clear();
        counts.clear();
    }
    ok
}

/// Calls `f` on each item of `seq` while it returns true, when `seq` is an exact `list` or
/// `tuple`; returns whether it was one and `f` accepted every item.
///
/// # Safety
/// `seq` must be alive, and `f` must run no Python code (the items are borrowed).
#[inline(always)]
unsafe fn for_each_exact_item(
    seq: *mut pyo3::ffi::PyObject,
    mut f: impl FnMut(*mut pyo3::ffi::PyObject) -> bool,
) -> bool {
    // SAFETY: as this function's.
    let py = Python::assume_attached();
    with_exact_items(py, seq, |items| items.iter().all(|&item| f(item))).unwrap_or(false)
}

/// Pushes the items of `seq` if it is an exact `list` or `tuple` of exact `int`s in the
/// token range (possibly some of them before returning false).
///
/// # Safety
/// As [`for_each_exact_item`].
#[inline(always)]
unsafe fn push_exact_seq(seq: *mut pyo3::ffi::PyObject, tokens: &mut Vec<u32>) -> bool {
    // SAFETY: as this function's.
    let py = Python::assume_attached();
    compact_int::with_reader(py, PushExactSeq { py, seq, tokens })
}

/// [`push_exact_seq`] with one int reader.
struct PushExactSeq<'a, 'py> {
    py: Python<'py>,
    seq: *mut pyo3::ffi::PyObject,
    tokens: &'a mut Vec<u32>,
}

impl compact_int::WithReader for PushExactSeq<'_, '_> {
    type Output = bool;

    #[inline(always)]
    fn run<R: compact_int::ReadInt>(self, reader: R) -> bool {
        let Self { py, seq, tokens } = self;
        // SAFETY: `seq` is alive and nothing here runs Python code (see `push_exact_token_ids`);
        // each item is checked to be an exact int before it is read as one.
        unsafe {
            with_exact_items(py, seq, |items| {
                tokens.reserve(items.len());
                items.iter().all(|&value| {
                    if pyo3::ffi::PyLong_CheckExact(value) == 0 {
                        return false;
                    }
                    match reader.value_up_to(value, MAX_TOKEN_ID as u32) {
                        Some(t) => {
                            tokens.push(t);
                            true
                        }
                        None => false,
                    }
                })
            })
            .unwrap_or(false)
        }
    }
}
