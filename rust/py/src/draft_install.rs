//! Installing a drafts dict (`update_draft_token_ids`) in the scheduler, inside its lock: the
//! one-pass read with each key resolved by identity (an interned id) or by its text, or the
//! ids of the general read resolved by text.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::draft_dict::{self, DraftTexts, LiveDrafts};
use crate::errors::IntoPyResult;
use crate::scheduler_state::State;

impl State {
    /// `update_draft_token_ids` of a dict the one-pass read takes (None for any other).
    pub(crate) fn install_exact_draft_dict(
        &mut self,
        py: Python<'_>,
        dict: &Bound<'_, PyDict>,
    ) -> PyResult<Option<usize>> {
        let k = self.inner.config().num_speculative_tokens;
        let live = draft_dict::read_exact(dict, k, |id| {
            match self.ids.slot_by_identity(&self.inner, id) {
                Some(found) => Ok(Some(found)),
                None => Ok(self.slot_by_text(&draft_dict::key_text(id)?)),
            }
        })?;
        match live {
            Some(live) => self.install_live_drafts(py, &live).map(Some),
            None => Ok(None),
        }
    }

    /// `update_draft_token_ids` of the drafts the general read took: unknown and finished ids
    /// are skipped.
    pub(crate) fn install_draft_texts(
        &mut self,
        py: Python<'_>,
        drafts: &DraftTexts,
    ) -> PyResult<usize> {
        let k = self.inner.config().num_speculative_tokens;
        let live = drafts.resolve(py, k, |id| self.slot_by_text(id))?;
        self.install_live_drafts(py, &live)
    }

    /// Installs drafts of live requests (the core skips waiting and prefill-chunk ones).
    fn install_live_drafts(&mut self, py: Python<'_>, live: &LiveDrafts) -> PyResult<usize> {
        self.inner
            .update_draft_token_ids_for_slots(&live.slots, &live.tokens, &live.counts)
            .py(py)
    }

    /// The live request (slot, generation) with id `id`.
    fn slot_by_text(&self, id: &str) -> Option<(u32, u32)> {
        let slot = self.inner.slot_of(id)?;
        let generation = self.inner.requests().slot_of_generation(slot)?;
        Some((slot, generation))
    }
}
