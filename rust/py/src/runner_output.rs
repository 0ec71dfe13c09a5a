//! Reading the model runner's output for a step (vLLM's `ModelRunnerOutput` or any object
//! with its attributes): its `req_ids` checked against the step, its sampled tokens (token
//! lists or flat arrays) and its drafts for the next step, as flat tokens + counts. Read
//! before the scheduler's lock is taken.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::convert::{flat_exact_token_lists, token_ids};
use crate::errors::{invalid, unless_fatal, wrong_type};
use crate::outputs::PySchedulerOutput;
use crate::scheduler_args::runner_attr;

/// A runner's output for one step, read and checked against the step.
pub(crate) struct RunnerOutput {
    /// Sampled tokens, flat, entry after entry in batch order.
    pub(crate) tokens: Vec<u32>,
    /// Sampled tokens per entry.
    pub(crate) counts: Vec<u32>,
    /// Drafts for the next step (flat tokens, per-entry counts), one list per entry, when the
    /// runner gave any (`draft_token_ids` not None).
    pub(crate) drafts: Option<(Vec<u32>, Vec<u32>)>,
}

impl RunnerOutput {
    /// Reads `runner_output` for the step of `out`: its `req_ids` must name the step's
    /// requests in order, and its drafts (if any) hold one list per sampled entry.
    pub(crate) fn read(
        py: Python<'_>,
        out: &PySchedulerOutput,
        runner_output: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let runner_ids = runner_output.getattr(intern!(py, "req_ids")).map_err(|e| {
            unless_fatal(py, e, || {
                invalid(
                    py,
                    "runner_output must be a ModelRunnerOutput (it has no req_ids)",
                )
            })
        })?;
        check_req_ids(py, out, &runner_ids)?;
        let (tokens, counts) = sampled_from_runner(py, runner_output)?;
        let drafts = runner_attr(runner_output, intern!(py, "draft_token_ids"))?;
        let drafts = if drafts.is_none() {
            None
        } else {
            let (draft_tokens, draft_counts) = drafts_from_runner(py, &drafts)?;
            if draft_counts.len() != counts.len() {
                return Err(invalid(
                    py,
                    format!(
                        "{} draft lists for {} requests",
                        draft_counts.len(),
                        counts.len()
                    ),
                ));
            }
            Some((draft_tokens, draft_counts))
        };
        Ok(Self {
            tokens,
            counts,
            drafts,
        })
    }
}

/// Checks that `runner_ids` names the step's requests in its order, element by element
/// (never trusted by identity: a list handed back may have been changed since).
fn check_req_ids(
    py: Python<'_>,
    output: &PySchedulerOutput,
    runner_ids: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let expected = output.req_ids.bind(py);
    let n = runner_ids
        .len()
        .map_err(|e| unless_fatal(py, e, || invalid(py, "req_ids must be a sequence of str")))?;
    if n != expected.len() {
        return Err(invalid(
            py,
            format!(
                "ModelRunnerOutput has {n} req_ids but the step scheduled {}",
                expected.len()
            ),
        ));
    }
    let mismatch = |i: usize, a: &Bound<'_, PyAny>, b: &Bound<'_, PyAny>| {
        invalid(
            py,
            format!("ModelRunnerOutput.req_ids[{i}] = {a} but the step scheduled {b} there"),
        )
    };
    // Lists and tuples: the ids are the scheduler's own interned strings, so a pointer
    // compare settles almost every element.
    if let Ok(list) = runner_ids.cast::<PyList>() {
        for (i, b) in expected.iter_borrowed().enumerate() {
            let a = list.get_item(i)?;
            if !a.is(&*b) && !a.eq(&*b)? {
                return Err(mismatch(i, &a, &b));
            }
        }
        return Ok(());
    }
    if let Ok(tuple) = runner_ids.cast::<PyTuple>() {
        for (i, (a, b)) in tuple
            .iter_borrowed()
            .zip(expected.iter_borrowed())
            .enumerate()
        {
            if !a.is(&*b) && !a.eq(&*b)? {
                return Err(mismatch(i, &a, &b));
            }
        }
        return Ok(());
    }
    for (i, (a, b)) in runner_ids.try_iter()?.zip(expected.iter()).enumerate() {
        let a = a?;
        if !a.is(&b) && !a.eq(&b)? {
            return Err(mismatch(i, &a, &b));
        }
    }
    Ok(())
}

/// Sampled tokens as flat tokens + counts, from lists or arrays.
fn sampled_from_runner(
    py: Python<'_>,
    runner: &Bound<'_, PyAny>,
) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let flat = runner_attr(runner, intern!(py, "sampled_tokens_flat"))?;
    if !flat.is_none() {
        let tokens = token_ids(&flat, "sampled_tokens_flat")?;
        let counts = token_ids(
            &runner_attr(runner, intern!(py, "num_sampled_tokens"))?,
            "num_sampled_tokens",
        )?;
        return Ok((tokens, counts));
    }
    let lists = runner_attr(runner, intern!(py, "sampled_token_ids"))?;
    let mut tokens = Vec::new();
    let mut counts = Vec::new();
    if flat_exact_token_lists(&lists, &mut tokens, &mut counts) {
        return Ok((tokens, counts));
    }
    for (i, item) in lists
        .try_iter()
        .map_err(|e| {
            unless_fatal(py, e, || {
                invalid(py, "sampled_token_ids must be a sequence")
            })
        })?
        .enumerate()
    {
        let item = item?;
        let t = token_ids(&item, format_args!("sampled_token_ids[{i}]"))?;
        counts.push(t.len() as u32);
        tokens.extend_from_slice(&t);
    }
    Ok((tokens, counts))
}

/// The runner's drafts for the next step (one token list per batch entry) as flat tokens
/// + counts.
fn drafts_from_runner(py: Python<'_>, drafts: &Bound<'_, PyAny>) -> PyResult<(Vec<u32>, Vec<u32>)> {
    let mut tokens = Vec::new();
    let mut counts = Vec::new();
    if flat_exact_token_lists(drafts, &mut tokens, &mut counts) {
        return Ok((tokens, counts));
    }
    let not_lists = || {
        wrong_type(
            py,
            "draft_token_ids must be a sequence of token lists (one per request) or None",
        )
    };
    let items = drafts
        .try_iter()
        .map_err(|e| unless_fatal(py, e, not_lists))?;
    for (i, item) in items.enumerate() {
        let t = token_ids(&item?, format_args!("draft_token_ids[{i}]"))?;
        counts.push(t.len() as u32);
        tokens.extend_from_slice(&t);
    }
    Ok((tokens, counts))
}
