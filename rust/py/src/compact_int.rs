//! The value of a small exact `int` (zero, or one 30-bit digit: every token id), read from the
//! object's memory without a call. CPython keeps an int's digit count and sign in one word
//! after the object header (`ob_size` up to 3.11, `lv_tag` from 3.12) and its first digit
//! right after it; the stable ABI this module is built for only offers
//! `PyLong_AsLongAndOverflow`, a call per token.
//!
//! Which of the two encodings the running interpreter uses is not assumed from its version: at
//! first use each decoder reads a set of ints whose values are known (through the API), and a
//! decoder is used only if it reads every small one right and never misreads any other. If
//! neither does, every read goes through `PyLong_AsLongAndOverflow`.

use std::os::raw::c_long;
use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;

/// How an int's size word encodes its digit count and sign.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Encoding {
    /// `ob_size` (CPython up to 3.11): the signed digit count.
    SignedSize,
    /// `lv_tag` (CPython 3.12 on): the digit count above three flag bits, whose low two give
    /// the sign (0 positive, 1 zero, 2 negative); the third marks immortal small ints in 3.14
    /// and is ignored here.
    Tagged,
}

impl Encoding {
    /// A name for tests and diagnostics.
    pub fn name(self) -> &'static str {
        match self {
            Self::SignedSize => "signed-size",
            Self::Tagged => "tagged",
        }
    }
}

/// The words of an int after its `PyObject` header: the size word, then the first digit.
#[repr(C)]
struct IntLayout {
    ob_base: ffi::PyObject,
    size: isize,
    digit0: u32,
}

/// Reads exact ints as token-sized values.
pub trait ReadInt: Copy {
    /// The value of the exact int `obj` if it lies in `0..=max` (`max` below 2**31), else
    /// None.
    ///
    /// # Safety
    /// `obj` must be a live exact `int`.
    unsafe fn value_up_to(self, obj: *mut ffi::PyObject, max: u32) -> Option<u32>;
}

/// Reads the size word (`lv_tag` if `TAGGED`, else `ob_size`), and asks the API for ints of
/// more than one digit.
#[derive(Clone, Copy)]
struct Direct<const TAGGED: bool>;

impl<const TAGGED: bool> ReadInt for Direct<TAGGED> {
    #[inline(always)]
    unsafe fn value_up_to(self, obj: *mut ffi::PyObject, max: u32) -> Option<u32> {
        let encoding = if TAGGED {
            Encoding::Tagged
        } else {
            Encoding::SignedSize
        };
        match read(obj, encoding) {
            Some(v) => (v <= max).then_some(v),
            None => Api.value_up_to(obj, max),
        }
    }
}

/// Reads through `PyLong_AsLongAndOverflow`.
#[derive(Clone, Copy)]
struct Api;

impl ReadInt for Api {
    #[inline(always)]
    unsafe fn value_up_to(self, obj: *mut ffi::PyObject, max: u32) -> Option<u32> {
        let mut overflow = 0;
        // An exact int raises nothing here: beyond a C long it reports `overflow` instead.
        let v = ffi::PyLong_AsLongAndOverflow(obj, &mut overflow);
        (overflow == 0 && (0..=c_long::from(max)).contains(&v)).then_some(v as u32)
    }
}

/// `Some(value)` of the exact int `obj` if it is zero or has a single digit, else None.
///
/// # Safety
/// `obj` must be a live exact `int`.
#[inline(always)]
unsafe fn read(obj: *mut ffi::PyObject, encoding: Encoding) -> Option<u32> {
    let int = &*obj.cast::<IntLayout>();
    let size = match encoding {
        Encoding::SignedSize => int.size,
        Encoding::Tagged => int.size & !4,
    };
    match (encoding, size) {
        (Encoding::SignedSize, 0) | (Encoding::Tagged, 1) => Some(0),
        (Encoding::SignedSize, 1) | (Encoding::Tagged, 8) => Some(int.digit0),
        _ => None,
    }
}

/// Work that reads ints: run with the fastest reader this interpreter allows, monomorphised
/// per reader so that the choice is made once per call, not once per int.
pub trait WithReader {
    type Output;
    fn run<R: ReadInt>(self, reader: R) -> Self::Output;
}

/// Runs `work` with this interpreter's reader.
#[inline(always)]
pub fn with_reader<W: WithReader>(py: Python<'_>, work: W) -> W::Output {
    match encoding(py) {
        Some(Encoding::SignedSize) => work.run(Direct::<false>),
        Some(Encoding::Tagged) => work.run(Direct::<true>),
        None => work.run(Api),
    }
}

/// The encoding that reads this interpreter's ints correctly (checked once), if any.
pub fn encoding(py: Python<'_>) -> Option<Encoding> {
    static ENCODING: OnceLock<Option<Encoding>> = OnceLock::new();
    *ENCODING.get_or_init(|| {
        [Encoding::SignedSize, Encoding::Tagged]
            .into_iter()
            .find(|&e| reads_right(py, e).unwrap_or(false))
    })
}

/// Whether `encoding` reads every small int of a test set right and misreads none of the rest.
fn reads_right(py: Python<'_>, encoding: Encoding) -> PyResult<bool> {
    const SMALL: [i64; 9] = [0, 1, 2, 7, 255, 256, 32_000, 1_000_003, (1 << 30) - 1];
    const OTHERS: [i64; 8] = [
        1 << 30,
        (1 << 31) - 1,
        1 << 40,
        -1,
        -2,
        -(1 << 30),
        -(1 << 40),
        i64::MAX,
    ];
    for (values, small) in [(&SMALL[..], true), (&OTHERS[..], false)] {
        for &v in values {
            let obj = v.into_pyobject(py)?;
            // SAFETY: `obj` is a live exact int.
            let read = unsafe { read(obj.as_ptr(), encoding) };
            let right = match read {
                Some(r) => i64::from(r) == v,
                None => !small,
            };
            if !right {
                return Ok(false);
            }
        }
    }
    Ok(true)
}
