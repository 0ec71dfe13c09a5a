//! The argument of `update_draft_token_ids`: `{req_id: [token, ...]}`.
//!
//! An exact dict of exact strs and exact lists (or tuples) of exact ints, as engines build it,
//! is read in one pass that runs no Python code, inside the scheduler's lock, each key resolved
//! as it is met: by identity when it is one of the scheduler's interned ids (the strs of
//! `req_ids`), by its text otherwise. Anything else is read entry by entry from a snapshot of
//! the items, outside the lock, with the precise errors.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyMapping, PyString};

use crate::convert::{push_exact_token_ids, token_ids};
use crate::errors::{invalid, unless_fatal, wrong_type};

/// The entries of a drafts dict whose requests are live, in the dict's order: entry `i` is
/// the request in (slot, generation) `slots[i]` and has the next `counts[i]` tokens.
#[derive(Default)]
pub struct LiveDrafts {
    pub slots: Vec<(u32, u32)>,
    pub tokens: Vec<u32>,
    pub counts: Vec<u32>,
}

/// A drafts dict read by the general path: entry `i` has request id `ids[i]` and the next
/// `counts[i]` tokens.
pub struct DraftTexts {
    ids: Vec<String>,
    tokens: Vec<u32>,
    counts: Vec<u32>,
}

/// `drafts` as a dict: the dict itself, or a dict copy of any other mapping
/// (`collections.abc.Mapping`: `MappingProxyType`, a user's class); else the typed error.
pub fn as_draft_dict<'py>(drafts: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyDict>> {
    let py = drafts.py();
    if let Ok(dict) = drafts.cast::<PyDict>() {
        return Ok(dict.clone());
    }
    let not_a_mapping = || wrong_type(py, "draft token ids must be a Mapping[str, Sequence[int]]");
    let mapping = drafts.cast::<PyMapping>().map_err(|_| not_a_mapping())?;
    let dict = PyDict::new(py);
    let items = mapping
        .items()
        .map_err(|e| unless_fatal(py, e, not_a_mapping))?;
    for item in items.iter() {
        let (key, value) = item
            .extract::<(Bound<'py, PyAny>, Bound<'py, PyAny>)>()
            .map_err(|e| unless_fatal(py, e, not_a_mapping))?;
        dict.set_item(key, value)
            .map_err(|e| unless_fatal(py, e, not_a_mapping))?;
    }
    Ok(dict)
}

/// The one-pass read of an exact dict of exact strs and token lists, `resolve` naming each
/// key's live request (None for unknown or finished ids). Ok(None) for any other dict (a
/// subclass may override `items`, and a value of another type needs Python calls): it must
/// take [`read_general`]. Refuses drafts over `k` for any request.
pub fn read_exact(
    dict: &Bound<'_, PyDict>,
    k: usize,
    mut resolve: impl FnMut(Borrowed<'_, '_, PyString>) -> PyResult<Option<(u32, u32)>>,
) -> PyResult<Option<LiveDrafts>> {
    if !dict.is_exact_instance_of::<PyDict>() {
        return Ok(None);
    }
    let py = dict.py();
    let n = dict.len();
    let mut live = LiveDrafts {
        slots: Vec::with_capacity(n),
        tokens: Vec::new(),
        counts: Vec::with_capacity(n),
    };
    // The first entry over K; refused once every key is read, as the general path reads
    // every entry before it checks K.
    let mut over_k: Option<(String, usize)> = None;
    let mut pos: pyo3::ffi::Py_ssize_t = 0;
    let mut key = std::ptr::null_mut();
    let mut value = std::ptr::null_mut();
    // SAFETY: `PyDict_Next` hands out borrowed entries of a live dict; nothing in the loop runs
    // Python code (see `push_exact_token_ids`; reading a str's text runs none either), so the
    // dict cannot change while it is walked and every borrowed entry stays alive.
    while unsafe { pyo3::ffi::PyDict_Next(dict.as_ptr(), &mut pos, &mut key, &mut value) } != 0 {
        if unsafe { pyo3::ffi::PyUnicode_CheckExact(key) } == 0 {
            return Ok(None);
        }
        let key = unsafe { Borrowed::from_ptr(py, key).cast_unchecked::<PyString>() };
        let before = live.tokens.len();
        if !push_exact_token_ids(unsafe { Borrowed::from_ptr(py, value) }, &mut live.tokens) {
            return Ok(None);
        }
        let count = live.tokens.len() - before;
        if count > k && over_k.is_none() {
            over_k = Some((key_text(key)?, count));
        }
        match resolve(key)? {
            Some(slot) => {
                live.slots.push(slot);
                live.counts.push(count as u32);
            }
            None => live.tokens.truncate(before),
        }
    }
    match over_k {
        Some((id, count)) => Err(too_many_drafts(py, &id, count, k)),
        None => Ok(Some(live)),
    }
}

/// Any dict, entry by entry (the items as they were when reading began): keys must be strs,
/// values token sequences.
pub fn read_general(dict: &Bound<'_, PyDict>) -> PyResult<DraftTexts> {
    let py = dict.py();
    let mut parsed = DraftTexts {
        ids: Vec::with_capacity(dict.len()),
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
        parsed.ids.push(id);
    }
    Ok(parsed)
}

impl DraftTexts {
    /// The live entries, `resolve` naming each id's live request. Refuses drafts over `k` for
    /// any request.
    pub fn resolve(
        &self,
        py: Python<'_>,
        k: usize,
        resolve: impl Fn(&str) -> Option<(u32, u32)>,
    ) -> PyResult<LiveDrafts> {
        if let Some(i) = self.counts.iter().position(|&c| c as usize > k) {
            let count = self.counts[i] as usize;
            return Err(too_many_drafts(py, &self.ids[i], count, k));
        }
        let mut live = LiveDrafts::default();
        let mut start = 0usize;
        for (id, &count) in self.ids.iter().zip(&self.counts) {
            let end = start + count as usize;
            if let Some(slot) = resolve(id) {
                live.slots.push(slot);
                live.counts.push(count);
                live.tokens.extend_from_slice(&self.tokens[start..end]);
            }
            start = end;
        }
        Ok(live)
    }
}

/// The text of a key (an exact str), or the typed error for one that holds a lone surrogate.
pub fn key_text(key: Borrowed<'_, '_, PyString>) -> PyResult<String> {
    key.extract().map_err(|e| not_keyed_by_str(key.py(), e))
}

#[cold]
fn too_many_drafts(py: Python<'_>, id: &str, count: usize, k: usize) -> PyErr {
    invalid(
        py,
        format!("request {id:?} got {count} draft tokens but at most K = {k} can be verified"),
    )
}

#[cold]
fn not_keyed_by_str(py: Python<'_>, err: PyErr) -> PyErr {
    unless_fatal(py, err, || {
        wrong_type(py, "draft token ids must be keyed by request id (str)")
    })
}
