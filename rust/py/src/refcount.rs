//! Reference counts changed in place, as C extensions built for CPython's stable ABI up to 3.11
//! change them (`Py_INCREF` and `Py_DECREF` are inline there), instead of pyo3's calls into the
//! interpreter (`Py_IncRef`, `Py_DecRef`), which an abi3 module makes for every reference.
//!
//! The object header's first word is the reference count on every CPython this abi3 module
//! loads in (free-threaded builds have no stable ABI it can target), and CPython 3.12+ keeps
//! such in-place changes valid for immortal objects: their count is so large that they never
//! bring it near zero. A decrement that would reach zero calls `Py_DecRef`, which deallocates.
//! Only the per-request loops of the vLLM bridge use these: elsewhere pyo3's calls are fine.

use std::mem::ManuallyDrop;
use std::ops::Deref;

use pyo3::ffi;
use pyo3::prelude::*;

/// The reference count word of `op`.
#[inline(always)]
fn count(op: *mut ffi::PyObject) -> *mut ffi::Py_ssize_t {
    op.cast()
}

/// Adds a reference to `op`.
///
/// # Safety
/// `op` is a live object and the caller is attached to the interpreter.
#[inline(always)]
pub unsafe fn incref(op: *mut ffi::PyObject) {
    let rc = count(op);
    *rc = (*rc).wrapping_add(1);
}

/// Adds a reference to `op` unless it is NULL.
///
/// # Safety
/// As [`incref`], for a non-NULL `op`.
#[inline(always)]
pub unsafe fn xincref(op: *mut ffi::PyObject) {
    if !op.is_null() {
        incref(op);
    }
}

/// Drops a reference to `op`, deallocating it (through `Py_DecRef`) when it was the last.
///
/// # Safety
/// `op` is a live object the caller owns a reference to, and the caller is attached.
#[inline(always)]
pub unsafe fn decref(op: *mut ffi::PyObject) {
    let rc = count(op);
    if *rc > 1 {
        *rc -= 1;
    } else {
        ffi::Py_DecRef(op);
    }
}

/// Drops a reference to `op` unless it is NULL.
///
/// # Safety
/// As [`decref`], for a non-NULL `op`.
#[inline(always)]
pub unsafe fn xdecref(op: *mut ffi::PyObject) {
    if !op.is_null() {
        decref(op);
    }
}

/// A new reference to `obj` (pyo3's `clone`, counted in place).
#[inline(always)]
pub fn new_ref<'py, T>(obj: &Bound<'py, T>) -> Bound<'py, T> {
    // SAFETY: `obj` is alive and the caller attached (it holds a `Bound`); the reference added
    // is the one the returned `Bound` owns.
    unsafe {
        incref(obj.as_ptr());
        Bound::from_owned_ptr(obj.py(), obj.as_ptr()).cast_into_unchecked::<T>()
    }
}

/// None, as a new reference counted in place.
#[inline(always)]
pub fn none(py: Python<'_>) -> Bound<'_, PyAny> {
    // SAFETY: None is always alive, and the caller is attached (it holds `py`).
    unsafe {
        let none = ffi::Py_None();
        incref(none);
        Bound::from_owned_ptr(py, none)
    }
}

/// An owned reference whose drop is counted in place (for the per-request temporaries of a
/// step: one per request, dropped together).
pub struct Owned<'py>(ManuallyDrop<Bound<'py, PyAny>>);

impl<'py> Owned<'py> {
    /// A new reference to the object `item` points to (an item of a sequence the caller holds).
    ///
    /// # Safety
    /// `item` is a live object for as long as this call, and `py` is attached.
    #[inline(always)]
    pub unsafe fn from_borrowed(py: Python<'py>, item: *mut ffi::PyObject) -> Self {
        incref(item);
        Self(ManuallyDrop::new(Bound::from_owned_ptr(py, item)))
    }

    /// Takes over `obj`'s reference.
    #[inline(always)]
    pub fn new(obj: Bound<'py, PyAny>) -> Self {
        Self(ManuallyDrop::new(obj))
    }
}

impl<'py> Deref for Owned<'py> {
    type Target = Bound<'py, PyAny>;

    #[inline(always)]
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Drop for Owned<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        // SAFETY: the reference is this handle's own, dropped once, while attached (the
        // `Bound` it wraps proves it).
        unsafe { decref(self.0.as_ptr()) }
    }
}
