//! Lists, tuples and objects of atomic items (ints, strs, None) handed out untracked by CPython's
//! cyclic garbage collector, as vLLM's own per-step structs are (`msgspec.Struct, gc=False`).
//!
//! A container can only be part of a reference cycle through a container it holds. The ones
//! built here hold ints and strs (or other containers built here), so the collector can never
//! free anything through them; tracking them only makes every collection scan them again. A
//! decode step of 1,024 requests hands vLLM several hundred of them (`new_block_ids`), most of
//! the young generation a collection walks. Untracking is conservative: should a caller later
//! put a container into one, a cycle through it is kept alive, never freed early.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use pyo3::IntoPyObjectExt;

use crate::seq_items::ListBuilder;

/// Takes `obj` out of the cyclic collector's lists.
///
/// The caller guarantees that `obj` holds nothing that can lead back to it (atomic items, or
/// containers that obey the same rule).
fn untrack<T>(obj: &Bound<'_, T>) {
    // SAFETY: the GIL is held and `obj` is a live object of a GC type (every caller passes a
    // list, tuple, dict or pyclass instance); untracking an untracked object is allowed.
    unsafe { ffi::PyObject_GC_UnTrack(obj.as_ptr().cast()) }
}

/// A new list of ints or strs, untracked.
pub fn list<'py, T, I>(py: Python<'py>, items: I) -> PyResult<Bound<'py, PyList>>
where
    I: IntoIterator<Item = T>,
    I::IntoIter: ExactSizeIterator,
    T: IntoPyObject<'py>,
{
    let items = items.into_iter();
    let mut list = ListBuilder::new(py, items.len())?;
    for item in items {
        list.push(item.into_bound_py_any(py)?);
    }
    Ok(list.finish())
}

/// `(list,)` where `list` was built by [`list`]: untracked too.
pub fn tuple1<'py>(list: Bound<'py, PyList>) -> PyResult<Bound<'py, PyTuple>> {
    let tuple = PyTuple::new(list.py(), [list])?;
    untrack(&tuple);
    Ok(tuple)
}

/// Untracks `obj`, a list, dict or pyclass instance the caller built, which holds nothing that
/// can lead back to it: atomic values, Rust data, lists of ints (the caller's promise).
pub fn seal<T>(obj: &Bound<'_, T>) {
    untrack(obj);
}
