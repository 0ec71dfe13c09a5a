//! Fast reads of exact Python lists of ints: items are borrowed (no reference counting) and
//! converted with one C call each. Anything else (a tuple, an array, an int subclass, a value
//! out of range) makes them return `None`, and the caller takes its checked path, which raises
//! the typed error. Reading an exact list of exact ints runs no Python code, so the list cannot
//! change while it is read.

use pyo3::ffi;
use pyo3::prelude::*;

use crate::convert::MAX_TOKEN_ID;

/// The value of an exact `int` in `[0, MAX_TOKEN_ID]`, else None.
///
/// # Safety
/// `item` must be a live object and the GIL held.
#[inline]
unsafe fn token_of(item: *mut ffi::PyObject) -> Option<u32> {
    if ffi::PyLong_CheckExact(item) == 0 {
        return None;
    }
    let v = ffi::PyLong_AsLong(item);
    if (0..=MAX_TOKEN_ID).contains(&(v as i64)) {
        Some(v as u32)
    } else {
        if v == -1 && !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear(); // an int too large for a C long: out of range anyway
        }
        None
    }
}

/// Appends the tokens of `obj`, if it is an exact list of exact ints that are token ids, to
/// `out` and returns how many; else leaves `out` as it was and returns None.
pub fn read_tokens(obj: &Bound<'_, PyAny>, out: &mut Vec<u32>) -> Option<u32> {
    let list = obj.as_ptr();
    // SAFETY: the GIL is held (`obj` is bound); items are borrowed from a list that no Python
    // code can change while the loop runs (it calls none).
    unsafe {
        if ffi::PyList_CheckExact(list) == 0 {
            return None;
        }
        let n = ffi::PyList_Size(list);
        let start = out.len();
        out.reserve(n as usize);
        for i in 0..n {
            match token_of(ffi::PyList_GetItem(list, i)) {
                Some(t) => out.push(t),
                None => {
                    out.truncate(start);
                    return None;
                }
            }
        }
        Some(n as u32)
    }
}

/// Whether item `i` of the exact list `list` is the very object `obj` (a pointer compare, no
/// reference counting). False when `i` is out of range or `list` is not an exact list.
pub fn item_is(list: &Bound<'_, PyAny>, i: usize, obj: &Bound<'_, PyAny>) -> bool {
    let ptr = list.as_ptr();
    // SAFETY: the GIL is held; the item is only compared, never dereferenced.
    unsafe {
        ffi::PyList_CheckExact(ptr) != 0
            && i < ffi::PyList_Size(ptr) as usize
            && std::ptr::eq(ffi::PyList_GetItem(ptr, i as ffi::Py_ssize_t), obj.as_ptr())
    }
}
