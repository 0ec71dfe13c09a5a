//! Installing the runner's draft tokens for the next step.

use crate::error::{invalid, CoreResult};
use crate::requests::request::RequestStatus;

use super::Scheduler;

impl Scheduler {
    /// Installs draft tokens for the next step; ignores unknown, finished, waiting and
    /// prefill-chunk requests. Returns how many requests took drafts. More than K drafts for any
    /// request is refused (`InvalidArgument`) and installs nothing.
    pub fn update_draft_token_ids<'a, I>(&mut self, drafts: I) -> CoreResult<usize>
    where
        I: IntoIterator<Item = (&'a str, &'a [u32])>,
        I::IntoIter: Clone,
    {
        let drafts = drafts.into_iter();
        let k = self.config.num_speculative_tokens;
        if let Some((id, tokens)) = drafts.clone().find(|(_, t)| t.len() > k) {
            return Err(invalid!(
                "request {id:?} got {} draft tokens but at most K = {k} can be verified",
                tokens.len()
            ));
        }
        let mut applied = 0;
        for (id, tokens) in drafts {
            let Some(slot) = self.store.slot_of(id) else {
                continue;
            };
            if let Ok(r) = self.store.get_mut(slot) {
                if r.status == RequestStatus::Running && !r.is_prefill_chunk {
                    r.set_drafts(tokens);
                    applied += 1;
                }
            }
        }
        Ok(applied)
    }

    /// Draft tokens for a step's batch, given as (slot, generation) per entry, in batch order;
    /// entry `i` gets the next `counts[i]` tokens. Same filtering as
    /// [`Self::update_draft_token_ids`]; entries whose request is gone are skipped.
    pub fn update_draft_token_ids_for_slots(
        &mut self,
        slots: &[(u32, u32)],
        tokens: &[u32],
        counts: &[u32],
    ) -> CoreResult<usize> {
        if slots.len() != counts.len() {
            return Err(invalid!(
                "{} requests but {} draft counts",
                slots.len(),
                counts.len()
            ));
        }
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        if total != tokens.len() {
            return Err(invalid!(
                "draft counts sum to {total} but {} draft tokens were given",
                tokens.len()
            ));
        }
        let k = self.config.num_speculative_tokens;
        if let Some(i) = counts.iter().position(|&c| c as usize > k) {
            return Err(invalid!(
                "the request at batch index {i} got {} draft tokens but at most K = {k} can be \
                 verified",
                counts[i]
            ));
        }
        let mut applied = 0;
        let mut start = 0;
        for (&(slot, generation), &count) in slots.iter().zip(counts) {
            let end = start + count as usize;
            if let Some(r) = self.store.get_mut_if_current(slot, generation) {
                if r.status == RequestStatus::Running && !r.is_prefill_chunk {
                    r.set_drafts(&tokens[start..end]);
                    applied += 1;
                }
            }
            start = end;
        }
        Ok(applied)
    }
}
