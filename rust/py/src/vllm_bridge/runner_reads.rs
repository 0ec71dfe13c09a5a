//! Reading what vLLM's runner hands back: the batch's ids, the sampled lists and the drafts.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

use dflash_core::PLACEHOLDER_TOKEN;

use super::bridge_state::SpecCounters;
use crate::convert::{push_exact_token_ids, token_ids};
use crate::errors::{invalid, unless_fatal};
use crate::outputs::PySchedulerOutput;
use crate::refcount::Owned;
use crate::seq_items::with_exact_items;

/// A scheduled token as vLLM shows it: a placeholder draft is -1.
pub(super) fn vllm_token(t: u32) -> i64 {
    if t == PLACEHOLDER_TOKEN {
        -1
    } else {
        i64::from(t)
    }
}

/// Whether `ids` (any sequence of str) names exactly `expected`, in order; compared element by
/// element (the interned strings make most comparisons a pointer check).
pub(super) fn same_ids(ids: &Bound<'_, PyAny>, expected: &Bound<'_, PyTuple>) -> PyResult<bool> {
    if ids.len()? != expected.len() {
        return Ok(false);
    }
    let py = ids.py();
    // The common case: the very same str objects, compared as pointers (nothing dereferenced).
    // SAFETY: both are alive and the closures run no Python code.
    let identical = unsafe {
        with_exact_items(py, ids.as_ptr(), |a| {
            with_exact_items(py, expected.as_ptr(), |b| a == b).unwrap_or(false)
        })
    };
    if identical == Some(true) {
        return Ok(true);
    }
    for (a, b) in ids.try_iter()?.zip(expected.iter()) {
        let a = a?;
        if !a.is(&b) && !a.eq(&b)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Each batch entry's sampled tokens (None: none sampled), from a vLLM `ModelRunnerOutput`
/// listed in the step's order or in any order (matched through `req_id_to_index`).
pub(super) fn sampled_lists<'py>(
    py: Python<'py>,
    out: &PySchedulerOutput,
    runner_output: &Bound<'py, PyAny>,
) -> PyResult<Vec<Option<Owned<'py>>>> {
    let expected = out.req_ids.bind(py);
    let n = expected.len();
    let sampled = runner_output.getattr(intern!(py, "sampled_token_ids"))?;
    if sampled.is_none() || sampled.len()? == 0 {
        return Ok((0..n).map(|_| None).collect());
    }
    let runner_ids = runner_output.getattr(intern!(py, "req_ids"))?;
    if same_ids(&runner_ids, expected)? {
        if sampled.len()? != n {
            return Err(invalid(
                py,
                format!(
                    "ModelRunnerOutput has {} sampled lists for {n} requests",
                    sampled.len()?
                ),
            ));
        }
        // SAFETY: `sampled` is alive (held here) and its items while it is not changed: the
        // new references are taken before anything else runs.
        let items = unsafe {
            with_exact_items(py, sampled.as_ptr(), |items| {
                items
                    .iter()
                    .map(|&item| Some(Owned::from_borrowed(py, item)))
                    .collect::<Vec<_>>()
            })
        };
        if let Some(items) = items {
            return Ok(items);
        }
        return (0..n)
            .map(|i| sampled.get_item(i).map(|v| Some(Owned::new(v))))
            .collect();
    }
    let index = runner_output.getattr(intern!(py, "req_id_to_index"))?;
    expected
        .iter()
        .map(|rid| {
            let i = index.get_item(&rid).map_err(|e| {
                unless_fatal(py, e, || {
                    invalid(
                        py,
                        format!("ModelRunnerOutput has no output for scheduled request {rid}"),
                    )
                })
            })?;
            sampled.get_item(i).map(|v| Some(Owned::new(v)))
        })
        .collect()
}

/// Appends the token ids of one list to `tokens` (an exact list of ints is read in place;
/// anything else through the checked conversion, whose errors name `what[i]`); returns how many.
pub(super) fn extend_tokens(
    list: &Bound<'_, PyAny>,
    tokens: &mut Vec<u32>,
    i: usize,
    what: &str,
) -> PyResult<u32> {
    let before = tokens.len();
    if push_exact_token_ids(list.as_borrowed(), tokens) {
        return Ok((tokens.len() - before) as u32);
    }
    let parsed = token_ids(list, format_args!("{what}[{i}]"))?;
    tokens.extend_from_slice(&parsed);
    Ok(parsed.len() as u32)
}

/// One step's speculative-decoding stats: the counters since `old`, the draft counts less the
/// placeholders that padded `invalid` requests' drafts (`(scheduled, invalid)`: the last
/// `invalid` of `scheduled` positions), as vLLM counts them; None when no drafts were verified.
pub(super) fn spec_delta(
    new: &SpecCounters,
    old: &SpecCounters,
    k: usize,
    invalid: &[(usize, u64)],
) -> Option<SpecDelta> {
    if new.drafts == old.drafts {
        return None;
    }
    let per_pos = |n: &[u64], o: &[u64]| -> Vec<i64> {
        (0..k)
            .map(|i| n.get(i).copied().unwrap_or(0) as i64 - o.get(i).copied().unwrap_or(0) as i64)
            .collect()
    };
    let mut delta = SpecDelta {
        drafts: new.drafts as i64 - old.drafts as i64,
        draft_tokens: new.draft_tokens as i64 - old.draft_tokens as i64,
        accepted: new.accepted as i64 - old.accepted as i64,
        accepted_per_pos: per_pos(&new.accepted_per_pos, &old.accepted_per_pos),
        drafted_per_pos: per_pos(&new.drafted_per_pos, &old.drafted_per_pos),
    };
    for &(scheduled, n) in invalid {
        delta.draft_tokens -= n as i64;
        for i in scheduled.saturating_sub(n as usize)..scheduled {
            if let Some(c) = delta.drafted_per_pos.get_mut(i) {
                *c -= 1;
            }
        }
    }
    Some(delta)
}

/// [`spec_delta`]'s result.
pub(super) struct SpecDelta {
    pub(super) drafts: i64,
    pub(super) draft_tokens: i64,
    pub(super) accepted: i64,
    pub(super) accepted_per_pos: Vec<i64>,
    pub(super) drafted_per_pos: Vec<i64>,
}
