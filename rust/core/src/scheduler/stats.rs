//! The scheduler's counters since construction ([`SchedulerStats`]).

use crate::kv_manager::PrefixCacheStats;

/// Counters since construction.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Preemptions.
    pub num_preemptions: u64,
    /// Steps scheduled.
    pub num_steps: u64,
    /// Requests that received draft tokens to verify, summed over steps.
    pub num_drafts: u64,
    /// Draft tokens verified.
    pub num_draft_tokens: u64,
    /// Draft tokens accepted.
    pub num_accepted_tokens: u64,
    /// Accepted drafts per draft position.
    pub num_accepted_tokens_per_pos: Vec<u64>,
    /// Requests that verified `i` drafts, for `i` in `0..=K` (entry 0 unused).
    pub num_drafts_by_count: Vec<u64>,
    /// Requests finished.
    pub num_finished: u64,
    /// Prefix-cache lookups of first admissions, counted when the request is scheduled, as
    /// vLLM's `PrefixCacheStats` counts them (a lookup that did not lead to an admission is not).
    pub admitted_prefix: PrefixCacheStats,
    /// The same for re-admissions after a preemption (vLLM's `preempted_*` counters).
    pub resumed_prefix: PrefixCacheStats,
}

impl SchedulerStats {
    /// Verified drafts per draft position (position `p` counts requests with more than `p`).
    pub fn num_draft_tokens_per_pos(&self) -> Vec<u64> {
        let mut per_pos: Vec<u64> = self.num_drafts_by_count.iter().skip(1).copied().collect();
        for p in (1..per_pos.len()).rev() {
            per_pos[p - 1] += per_pos[p];
        }
        per_pos
    }
}

/// One update's draft counters, added to the [`SchedulerStats`] at its end: one count per
/// request instead of one per accepted position.
#[derive(Debug, Default)]
pub(super) struct DraftTally {
    drafts: u64,
    draft_tokens: u64,
    accepted_tokens: u64,
    /// Requests by accepted drafts, capped at the number of positions counted.
    by_accepted: Vec<u64>,
}

impl DraftTally {
    /// Empties the tally, for stats counting `num_positions` positions.
    pub(super) fn start(&mut self, num_positions: usize) {
        (self.drafts, self.draft_tokens, self.accepted_tokens) = (0, 0, 0);
        self.by_accepted.clear();
        self.by_accepted.resize(num_positions + 1, 0);
    }

    /// Counts a request that verified `num_drafts` drafts and accepted `accepted` of them.
    #[inline]
    pub(super) fn count(&mut self, num_drafts: u32, accepted: u32) {
        self.drafts += 1;
        self.draft_tokens += u64::from(num_drafts);
        self.accepted_tokens += u64::from(accepted);
        let capped = (accepted as usize).min(self.by_accepted.len().saturating_sub(1));
        if let Some(c) = self.by_accepted.get_mut(capped) {
            *c += 1;
        }
    }

    /// Adds the tally to `stats` (whose positions it was started with).
    pub(super) fn add_to(&self, stats: &mut SchedulerStats) {
        stats.num_drafts += self.drafts;
        stats.num_draft_tokens += self.draft_tokens;
        stats.num_accepted_tokens += self.accepted_tokens;
        // Position `p` counts the requests that accepted more than `p` drafts.
        let mut more = 0;
        for (p, c) in stats
            .num_accepted_tokens_per_pos
            .iter_mut()
            .enumerate()
            .rev()
        {
            more += self.by_accepted[p + 1];
            *c += more;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tally counts what counting each accepted position one by one counts.
    #[test]
    fn tally_matches_counting_each_position() {
        let cases = [(3, 0), (3, 3), (2, 1), (5, 5), (3, 2)];
        for positions in [0, 1, 3] {
            let mut want = SchedulerStats {
                num_accepted_tokens_per_pos: vec![7; positions],
                ..Default::default()
            };
            let mut got = want.clone();
            let mut tally = DraftTally::default();
            tally.start(positions);
            for (drafts, accepted) in cases {
                want.num_drafts += 1;
                want.num_draft_tokens += drafts;
                want.num_accepted_tokens += accepted;
                for p in 0..accepted as usize {
                    if let Some(c) = want.num_accepted_tokens_per_pos.get_mut(p) {
                        *c += 1;
                    }
                }
                tally.count(drafts as u32, accepted as u32);
            }
            tally.add_to(&mut got);
            assert_eq!(got, want, "{positions} positions");
        }
    }
}
