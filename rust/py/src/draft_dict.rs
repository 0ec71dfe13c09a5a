//! The argument of `update_draft_token_ids`: `{req_id: [token, ...]}`.
//!
//! An exact dict of exact strs and exact lists (or tuples) of exact ints, as engines build it,
//! is read in one pass that runs no Python code; the scheduler then resolves its keys to slots
//! by identity when they are its own interned ids (the strs of `req_ids`). Anything else is
//! read entry by entry from a snapshot of the items, with the precise errors.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString};

use crate::convert::{push_exact_token_ids, token_ids};
use crate::errors::{unless_fatal, wrong_type};

/// A parsed drafts dict, in the dict's order: entry `i` has key `keys[i]` and the next
/// `counts[i]` tokens of `tokens`.
pub struct DraftDict<'py> {
    pub keys: Vec<DraftKey<'py>>,
    pub tokens: Vec<u32>,
    pub counts: Vec<u32>,
}

/// A key of a drafts dict.
pub enum DraftKey<'py> {
    /// An exact `str`, not read yet (the scheduler may know it by identity).
    Str(Bound<'py, PyString>),
    /// A key the general path read.
    Text(String),
}

impl DraftKey<'_> {
    /// The request id the key names.
    pub fn text(&self) -> PyResult<String> {
        match self {
            Self::Str(s) => s.extract().map_err(|e| not_keyed_by_str(s.py(), e)),
            Self::Text(s) => Ok(s.clone()),
        }
    }
}

/// Parses `{req_id: [token, ...]}` (the items as they were when parsing began).
pub fn parse_draft_dict<'py>(
    py: Python<'py>,
    drafts: &Bound<'py, PyAny>,
) -> PyResult<DraftDict<'py>> {
    let dict = drafts
        .cast::<PyDict>()
        .map_err(|_| wrong_type(py, "draft token ids must be a dict[str, list[int]]"))?;
    match exact_draft_dict(dict) {
        Some(parsed) => Ok(parsed),
        None => general_draft_dict(py, dict),
    }
}

/// The one-pass read of an exact dict of exact strs and token lists; None for any other dict
/// (a subclass may override `items`, and a value of another type needs Python calls).
fn exact_draft_dict<'py>(dict: &Bound<'py, PyDict>) -> Option<DraftDict<'py>> {
    if !dict.is_exact_instance_of::<PyDict>() {
        return None;
    }
    let py = dict.py();
    let n = dict.len();
    let mut parsed = DraftDict {
        keys: Vec::with_capacity(n),
        tokens: Vec::new(),
        counts: Vec::with_capacity(n),
    };
    let mut pos: pyo3::ffi::Py_ssize_t = 0;
    let mut key = std::ptr::null_mut();
    let mut value = std::ptr::null_mut();
    // SAFETY: `PyDict_Next` hands out borrowed entries of a live dict; nothing in the loop runs
    // Python code (see `push_exact_token_ids`; taking a reference to a key runs none either),
    // so the dict cannot change while it is walked and every borrowed entry stays alive.
    while unsafe { pyo3::ffi::PyDict_Next(dict.as_ptr(), &mut pos, &mut key, &mut value) } != 0 {
        if unsafe { pyo3::ffi::PyUnicode_CheckExact(key) } == 0 {
            return None;
        }
        let key = unsafe { Bound::from_borrowed_ptr(py, key).cast_into_unchecked::<PyString>() };
        let value = unsafe { Borrowed::from_ptr(py, value) };
        let before = parsed.tokens.len();
        if !push_exact_token_ids(value, &mut parsed.tokens) {
            return None;
        }
        parsed.counts.push((parsed.tokens.len() - before) as u32);
        parsed.keys.push(DraftKey::Str(key));
    }
    Some(parsed)
}

/// Any dict, entry by entry: keys must be strs, values token sequences.
fn general_draft_dict<'py>(py: Python<'py>, dict: &Bound<'py, PyDict>) -> PyResult<DraftDict<'py>> {
    let mut parsed = DraftDict {
        keys: Vec::with_capacity(dict.len()),
        tokens: Vec::new(),
        counts: Vec::with_capacity(dict.len()),
    };
    // A snapshot of the items: a token's `__index__` may mutate the dict while it is parsed,
    // which would make a live iterator panic.
    for item in dict.items().iter() {
        let (k, v) = item.extract::<(Bound<'_, PyAny>, Bound<'_, PyAny>)>()?;
        let id: String = k.extract().map_err(|e| not_keyed_by_str(py, e))?;
        let tokens = token_ids(&v, format_args!("draft_token_ids[{id:?}]"))?;
        parsed.counts.push(tokens.len() as u32);
        parsed.tokens.extend_from_slice(&tokens);
        parsed.keys.push(DraftKey::Text(id));
    }
    Ok(parsed)
}

#[cold]
fn not_keyed_by_str(py: Python<'_>, err: PyErr) -> PyErr {
    unless_fatal(py, err, || {
        wrong_type(py, "draft token ids must be keyed by request id (str)")
    })
}
