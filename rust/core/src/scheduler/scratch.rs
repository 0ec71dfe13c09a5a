//! The per-step scratch arrays of `schedule()`, indexed by slot and reused across steps.

use crate::output::EntryKind;

/// Per-step scratch state of `schedule()`.
#[derive(Debug, Default)]
pub(super) struct StepScratch {
    /// Tokens scheduled per slot this step (0 = not scheduled).
    pub(super) scheduled: Vec<u32>,
    /// Entry kind per slot.
    pub(super) kind: Vec<Option<EntryKind>>,
    /// First new block index per slot.
    pub(super) new_blocks_start: Vec<u32>,
    /// Computed tokens before this step per slot.
    pub(super) computed_before: Vec<u32>,
    /// Prefix-cached blocks before this step's allocation, per slot.
    pub(super) cached_before: Vec<u32>,
    /// Draft tokens scheduled per slot: the first ones of the request's `spec_token_ids`,
    /// which keep them until `finish_step` copies them out.
    pub(super) num_spec: Vec<u32>,
    /// Position in this step's scheduling order, per scheduled slot.
    pub(super) rank: Vec<u32>,
    pub(super) hits: Vec<u32>,
    /// `update_from_output`'s second pass: (rank, slot, tokens done) of requests with blocks
    /// to cache.
    pub(super) to_cache: Vec<(u32, u32, usize)>,
}

impl StepScratch {
    /// Grows the arrays to `num_slots` slots.
    pub(super) fn ensure(&mut self, num_slots: usize) {
        if self.scheduled.len() < num_slots {
            self.scheduled.resize(num_slots, 0);
            self.kind.resize(num_slots, None);
            self.new_blocks_start.resize(num_slots, 0);
            self.computed_before.resize(num_slots, 0);
            self.cached_before.resize(num_slots, 0);
            self.num_spec.resize(num_slots, 0);
            self.rank.resize(num_slots, 0);
        }
    }

    /// Takes `slot` back out of this step (a victim preempted after it was scheduled).
    pub(super) fn unschedule(&mut self, slot: u32) {
        let s = slot as usize;
        if s < self.scheduled.len() {
            self.scheduled[s] = 0;
            self.kind[s] = None;
            self.num_spec[s] = 0;
        }
    }
}
