//! The items of an exact `list` or `tuple` as a slice of borrowed pointers, read from the
//! object's memory as CPython's own `PyList_GET_ITEM` and `PyTuple_GET_ITEM` macros read them.
//! Those macros are outside the stable ABI this module is built for (one call of
//! `PyList_GetItem` per item instead), so the layout they rely on, the same from CPython 3.0 to
//! 3.14, is checked against `PyList_GetItem` and `PyTuple_GetItem` once, at first use. Where it
//! does not hold, the items are collected through those calls instead.

use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

/// A list's header: `PyObject_VAR_HEAD`, then a pointer to its item array.
#[repr(C)]
struct ListLayout {
    ob_base: ffi::PyVarObject,
    ob_item: *mut *mut ffi::PyObject,
}

/// A tuple's header: `PyObject_VAR_HEAD`, then its items in place.
#[repr(C)]
struct TupleLayout {
    ob_base: ffi::PyVarObject,
    ob_item: [*mut ffi::PyObject; 0],
}

/// Calls `f` with the items of `seq` when it is an exact `list` or `tuple` (and returns its
/// result), else returns None.
///
/// # Safety
/// `seq` must be a live object, and `f` must run no Python code: the items are borrowed, and a
/// list could be resized or its items freed under them.
#[inline(always)]
pub unsafe fn with_exact_items<R>(
    py: Python<'_>,
    seq: *mut ffi::PyObject,
    f: impl FnOnce(&[*mut ffi::PyObject]) -> R,
) -> Option<R> {
    let is_list = ffi::PyList_CheckExact(seq) != 0;
    if !is_list && ffi::PyTuple_CheckExact(seq) == 0 {
        return None;
    }
    if layout_holds(py) {
        let len = (*seq.cast::<ffi::PyVarObject>()).ob_size as usize;
        let items = if is_list {
            (*seq.cast::<ListLayout>()).ob_item.cast_const()
        } else {
            (*seq.cast::<TupleLayout>()).ob_item.as_ptr()
        };
        if len == 0 {
            return Some(f(&[]));
        }
        return Some(f(std::slice::from_raw_parts(items, len)));
    }
    let items: Vec<*mut ffi::PyObject> = if is_list {
        (0..ffi::PyList_Size(seq))
            .map(|i| ffi::PyList_GetItem(seq, i))
            .collect()
    } else {
        (0..ffi::PyTuple_Size(seq))
            .map(|i| ffi::PyTuple_GetItem(seq, i))
            .collect()
    };
    Some(f(&items))
}

/// Whether lists and tuples have the layout `ListLayout` and `TupleLayout` describe (checked
/// once).
pub fn layout_holds(py: Python<'_>) -> bool {
    static HOLDS: OnceLock<bool> = OnceLock::new();
    *HOLDS.get_or_init(|| check_layout(py).unwrap_or(false))
}

/// Reads a list (grown item by item, so its array was reallocated) and a tuple of distinct
/// objects both ways, and compares.
fn check_layout(py: Python<'_>) -> PyResult<bool> {
    let objects: Vec<Bound<'_, PyAny>> = (0..37_i64)
        .map(|i| Ok((1_000_000 + i).into_pyobject(py)?.into_any()))
        .collect::<PyResult<_>>()?;
    let list = PyList::empty(py);
    for o in &objects {
        list.append(o)?;
    }
    let tuple = PyTuple::new(py, &objects)?;
    let expected: Vec<*mut ffi::PyObject> = objects.iter().map(Bound::as_ptr).collect();
    // SAFETY: both are live; the reads stay within the sizes the headers report, which are
    // compared with the known length first.
    let read = |seq: *mut ffi::PyObject, is_list: bool| unsafe {
        let len = (*seq.cast::<ffi::PyVarObject>()).ob_size as usize;
        if len != expected.len() {
            return false;
        }
        let items = if is_list {
            (*seq.cast::<ListLayout>()).ob_item.cast_const()
        } else {
            (*seq.cast::<TupleLayout>()).ob_item.as_ptr()
        };
        std::slice::from_raw_parts(items, len) == expected.as_slice()
    };
    Ok(read(list.as_ptr(), true) && read(tuple.as_ptr(), false))
}

/// Fills a new list of a known length, item by item, in place (`PyList_SET_ITEM`'s way where
/// the layout was checked, else `PyList_SetItem`). The list is untracked by the cyclic
/// collector from the start (its items are ints, strs, None or containers built the same way,
/// see `untracked`), so no collection can see it half filled.
pub struct ListBuilder<'py> {
    list: Bound<'py, PyList>,
    /// The list's item array, or NULL to go through `PyList_SetItem`.
    items: *mut *mut ffi::PyObject,
    len: usize,
    filled: usize,
}

impl<'py> ListBuilder<'py> {
    /// An empty builder of a list of `len` items.
    pub fn new(py: Python<'py>, len: usize) -> PyResult<Self> {
        // SAFETY: `PyList_New` returns a new list (its items NULL) or NULL with an exception
        // set; `PyObject_GC_UnTrack` takes a tracked GC object.
        let list = unsafe {
            let list = ffi::PyList_New(len as ffi::Py_ssize_t);
            if list.is_null() {
                return Err(PyErr::fetch(py));
            }
            ffi::PyObject_GC_UnTrack(list.cast());
            Bound::from_owned_ptr(py, list).cast_into_unchecked::<PyList>()
        };
        let items = if layout_holds(py) && len > 0 {
            // SAFETY: an exact list, laid out as `ListLayout` (checked).
            unsafe { (*list.as_ptr().cast::<ListLayout>()).ob_item }
        } else {
            std::ptr::null_mut()
        };
        Ok(Self {
            list,
            items,
            len,
            filled: 0,
        })
    }

    /// Sets the next item.
    ///
    /// # Panics
    /// If the list is already full.
    #[inline]
    pub fn push(&mut self, item: Bound<'py, PyAny>) {
        assert!(
            self.filled < self.len,
            "ListBuilder: more items than its length"
        );
        let item = item.into_ptr();
        // SAFETY: `filled` is within the list's length, and the slot is still NULL; the list
        // takes over the reference. The item array does not move: the list is never resized.
        unsafe {
            if self.items.is_null() {
                ffi::PyList_SetItem(self.list.as_ptr(), self.filled as ffi::Py_ssize_t, item);
            } else {
                *self.items.add(self.filled) = item;
            }
        }
        self.filled += 1;
    }

    /// The list, once every item is set.
    ///
    /// # Panics
    /// If some item was not set.
    pub fn finish(self) -> Bound<'py, PyList> {
        assert_eq!(
            self.filled, self.len,
            "ListBuilder: fewer items than its length"
        );
        self.list
    }
}
