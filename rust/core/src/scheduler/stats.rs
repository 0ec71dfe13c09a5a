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
