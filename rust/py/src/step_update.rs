//! Applying the model's output for a step (`update_from_output*`): the output checked to be
//! this scheduler's, the sampled tokens applied in the core, the runner's drafts installed
//! for the next step, and the update handed back as one `RequestOutput` per request.

use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::errors::{invalid, IntoPyResult};
use crate::outputs::{PyRequestOutput, PySchedulerOutput};
use crate::runner_output::RunnerOutput;
use crate::scheduler_state::{PyScheduler, State};
use crate::untracked;

impl State {
    /// Rejects an output of another scheduler.
    pub(crate) fn check_owner(&self, py: Python<'_>, output: &PySchedulerOutput) -> PyResult<()> {
        if output.parts.scheduler_uid != self.inner.uid() {
            return Err(invalid(
                py,
                "this SchedulerOutput was produced by another Scheduler",
            ));
        }
        Ok(())
    }

    /// Applies sampled tokens (flat, with per-entry counts in batch order) to `out`'s step.
    pub(crate) fn apply_tokens(
        &mut self,
        py: Python<'_>,
        out: &PySchedulerOutput,
        tokens: &[u32],
        counts: &[u32],
    ) -> PyResult<()> {
        self.check_owner(py, out)?;
        if out.parts.slots.is_empty() && !tokens.is_empty() {
            // An empty step awaits no output (the core only reports what ended meanwhile).
            return Err(invalid(
                py,
                "sampled tokens were given for a step that scheduled nothing",
            ));
        }
        let step_id = out.step_id;
        let (inner, update) = (&mut self.inner, &mut self.update);
        inner
            .update_from_output(step_id, tokens, counts, update)
            .py(py)
    }

    /// One `RequestOutput` per request in the last update, in batch order, then one per request
    /// the scheduler ended on its own (no tokens).
    pub(crate) fn request_outputs(&self, py: Python<'_>) -> PyResult<Py<PyList>> {
        let update = &self.update;
        let mut outputs = Vec::with_capacity(update.updates.len() + update.ended.len());
        for u in &update.updates {
            let ro = Bound::new(
                py,
                PyRequestOutput::new(
                    py,
                    self.ids.id_of(py, u.slot)?,
                    &update.new_token_ids[u.tokens_start as usize..u.tokens_end as usize],
                    u.finish_reason,
                    u.finish_reason.and(u.stop_token),
                )?,
            )?;
            // A RequestOutput holds only strs, ints, None and Rust data, so it can never be
            // part of a reference cycle: one object per request per step kept out of the
            // collector's young generation.
            untracked::seal(&ro);
            outputs.push(ro.into_any());
        }
        for e in &update.ended {
            outputs.push(Bound::new(py, PyRequestOutput::ended(py, e)?)?.into_any());
        }
        Ok(PyList::new(py, outputs)?.unbind())
    }
}

impl PyScheduler {
    /// The body of `update_from_output*`: validates `runner_output` against `output`, applies
    /// it in the core, installs any drafts it carries, and builds the result with `build`.
    pub(crate) fn apply_output<R>(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PySchedulerOutput>,
        runner_output: &Bound<'_, PyAny>,
        build: impl FnOnce(&State) -> PyResult<R>,
    ) -> PyResult<R> {
        let out = output.get();
        let RunnerOutput {
            tokens,
            counts,
            drafts: runner_drafts,
        } = RunnerOutput::read(py, out, runner_output)?;
        self.with_state(py, |st| {
            let k = st.inner.config().num_speculative_tokens;
            if let Some((_, draft_counts)) = &runner_drafts {
                // Checked before the output is applied, so that a refusal changes nothing.
                if let Some(i) = draft_counts.iter().position(|&c| c as usize > k) {
                    return Err(invalid(
                        py,
                        format!(
                            "draft_token_ids[{i}] has {} tokens but at most K = {k} can be \
                             verified",
                            draft_counts[i]
                        ),
                    ));
                }
            }
            st.apply_tokens(py, out, &tokens, &counts)?;
            let result = build(st)?;
            if let Some((draft_tokens, draft_counts)) = runner_drafts
                .as_ref()
                .filter(|(_, draft_counts)| !draft_counts.is_empty())
            {
                // Cannot fail: one list per batch entry (an update that samples for a step
                // takes one sample per entry), each checked against K above. Entries that
                // finished in the update are gone from their slots, so they take none.
                st.inner
                    .update_draft_token_ids_for_slots(&out.parts.slots, draft_tokens, draft_counts)
                    .py(py)?;
            }
            st.forget_finished();
            Ok(result)
        })
    }
}
