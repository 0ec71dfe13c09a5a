//! The per-step scratch arrays of `schedule()`, indexed by slot and reused across steps.

use crate::hashing::BlockHash;
use crate::output::EntryKind;

use super::stats::DraftTally;

/// What `schedule()` records about one slot in the step it plans.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SlotStep {
    /// Tokens scheduled (0 = not scheduled).
    pub(super) scheduled: u32,
    /// Entry kind.
    pub(super) kind: Option<EntryKind>,
    /// First new block index.
    pub(super) new_blocks_start: u32,
    /// Computed tokens before this step.
    pub(super) computed_before: u32,
    /// Prefix-cached blocks before this step's allocation.
    pub(super) cached_before: u32,
    /// Draft tokens scheduled: the first ones of the request's `spec_token_ids`, which keep
    /// them until `finish_step` copies them out.
    pub(super) num_spec: u32,
    /// Position in this step's scheduling order (scheduled slots).
    pub(super) rank: u32,
}

/// Per-step scratch state of `schedule()`.
#[derive(Debug, Default)]
pub(super) struct StepScratch {
    /// Per slot (one record, so a slot's fields are one bounds check and one line away).
    pub(super) slots: Vec<SlotStep>,
    pub(super) hits: Vec<u32>,
    /// `update_from_output`'s second pass: (rank, slot, tokens done) of requests with blocks
    /// to cache.
    pub(super) to_cache: Vec<(u32, u32, usize)>,
    /// The running requests whose next allocation registers blocks (prefetched before the
    /// running phase allocates).
    pub(super) registering: Vec<u32>,
    /// The hashes of the blocks `update_from_output`, or the running phase, will register
    /// (their chains are prefetched in a later wave).
    pub(super) cache_hashes: Vec<BlockHash>,
    /// `update_from_output`'s draft counters.
    pub(super) tally: DraftTally,
}

impl StepScratch {
    /// Grows the per-slot records to `num_slots` slots.
    pub(super) fn ensure(&mut self, num_slots: usize) {
        if self.slots.len() < num_slots {
            self.slots.resize(num_slots, SlotStep::default());
        }
    }

    /// Takes `slot` back out of this step (a victim preempted after it was scheduled).
    pub(super) fn unschedule(&mut self, slot: u32) {
        if let Some(e) = self.slots.get_mut(slot as usize) {
            e.scheduled = 0;
            e.kind = None;
            e.num_spec = 0;
        }
    }
}
