//! The one error type of the core. The bindings map each variant to a Python exception.

use thiserror::Error;

/// Everything that can go wrong in the core. Every fallible public call returns this and leaves
/// the state it was given unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CoreError {
    /// An argument is out of range or inconsistent (maps to `ValueError`).
    #[error("{0}")]
    InvalidArgument(String),
    /// A request id is not known (maps to `KeyError`).
    #[error("unknown request id {0:?}")]
    UnknownRequest(String),
    /// A request id is already in use (maps to `DuplicateRequestError`).
    #[error("request id {0:?} is already in use")]
    DuplicateRequest(String),
    /// A prompt or sequence does not fit the model's context (maps to `PromptTooLongError`).
    #[error("{0}")]
    TooLong(String),
    /// The pool cannot serve a request that must be served (maps to `OutOfBlocksError`).
    #[error("{0}")]
    OutOfBlocks(String),
    /// A call does not fit the object's current state, e.g. a model output applied twice
    /// (maps to `StateError`).
    #[error("{0}")]
    State(String),
    /// An internal invariant is broken: a bug in dflash-rs (maps to `InvariantError`).
    #[error("invariant violated: {0}")]
    Invariant(String),
}

/// Result alias of the core.
pub type CoreResult<T> = Result<T, CoreError>;

/// Shorthand for an `InvalidArgument` error built with `format!`.
macro_rules! invalid {
    ($($arg:tt)*) => { $crate::error::CoreError::InvalidArgument(format!($($arg)*)) };
}
pub(crate) use invalid;

/// Shorthand for an `Invariant` error built with `format!`.
macro_rules! broken {
    ($($arg:tt)*) => { $crate::error::CoreError::Invariant(format!($($arg)*)) };
}
pub(crate) use broken;

/// A vector of `len` copies of `value`, or an error instead of an abort when memory runs out.
/// Large vectors are backed by huge pages where the OS allows (see [`crate::memory::huge_pages`]).
pub fn try_filled_vec<T: Clone>(len: usize, value: T, what: &str) -> CoreResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        CoreError::InvalidArgument(format!(
            "cannot allocate {what} of {len} entries: out of memory"
        ))
    })?;
    crate::memory::huge_pages::advise(&v);
    v.resize(len, value);
    Ok(v)
}

/// `len` zeroed `i32`s that the OS maps lazily (one `calloc`: untouched pages cost no memory),
/// backed by huge pages where the OS allows, or an error instead of an abort when memory runs
/// out.
pub fn try_zeroed_i32(len: usize, what: &str) -> CoreResult<Vec<i32>> {
    let oom = || {
        CoreError::InvalidArgument(format!(
            "cannot allocate {what} of {len} entries: out of memory"
        ))
    };
    if len == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<i32>(len).map_err(|_| oom())?;
    // SAFETY: `layout` has a non-zero size. A non-null result is a zeroed allocation of exactly
    // `len` i32s made with the global allocator and this layout, which is what
    // `Vec::from_raw_parts` takes ownership of (all `len` elements initialised: zero is an i32).
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<i32>();
        if ptr.is_null() {
            return Err(oom());
        }
        let v = Vec::from_raw_parts(ptr, len, len);
        crate::memory::huge_pages::advise(&v);
        Ok(v)
    }
}
