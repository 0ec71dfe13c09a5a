//! Calls with positional arguments through CPython's vectorcall protocol, without building an
//! argument tuple. `PyObject_Vectorcall` is exported from CPython 3.11 on (and in the stable
//! ABI from 3.12); this abi3 module is built for 3.9, so it looks the function up at run time
//! and falls back to an ordinary call (with a tuple) where the interpreter does not export it.

use std::ffi::{c_char, c_void};
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

type VectorcallFn = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    usize,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

#[cfg(unix)]
extern "C" {
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}

/// `PyObject_Vectorcall` of the running interpreter, if it exports one.
fn vectorcall() -> Option<VectorcallFn> {
    static FN: OnceLock<Option<VectorcallFn>> = OnceLock::new();
    *FN.get_or_init(|| {
        #[cfg(unix)]
        {
            #[cfg(target_os = "macos")]
            let default = -2isize as *mut c_void; // RTLD_DEFAULT
            #[cfg(not(target_os = "macos"))]
            let default = std::ptr::null_mut(); // RTLD_DEFAULT
                                                // SAFETY: dlsym with a NUL-terminated name; a non-null result is the address of
                                                // CPython's `PyObject_Vectorcall`, whose signature `VectorcallFn` is.
            unsafe {
                let f = dlsym(default, c"PyObject_Vectorcall".as_ptr());
                (!f.is_null()).then(|| std::mem::transmute::<*mut c_void, VectorcallFn>(f))
            }
        }
        #[cfg(not(unix))]
        {
            None
        }
    })
}

/// `callable(a, b)`.
pub fn call2<'py>(
    callable: &Bound<'py, PyAny>,
    a: &Bound<'py, PyAny>,
    b: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = callable.py();
    let Some(f) = vectorcall() else {
        return callable.call1(PyTuple::new(py, [a, b])?);
    };
    let args = [a.as_ptr(), b.as_ptr()];
    // SAFETY: the GIL is held; `args` holds two borrowed, live objects for the call's duration;
    // the result is a new reference or NULL with an exception set.
    unsafe {
        let r = f(callable.as_ptr(), args.as_ptr(), 2, std::ptr::null_mut());
        Bound::from_owned_ptr_or_err(py, r)
    }
}
