//! Steps awaiting their model output: what each scheduled entry needs when its output arrives
//! (or its step is abandoned).

/// A scheduled entry awaiting its model output.
#[derive(Debug, Clone, Copy)]
pub(super) struct InFlightEntry {
    pub(super) slot: u32,
    pub(super) generation: u32,
    /// Position in scheduling order (running requests first, then admissions), which is the
    /// order vLLM processes outputs in; batch order is block-table row order.
    pub(super) rank: u32,
    pub(super) num_spec_tokens: u32,
    pub(super) is_prefill_chunk: bool,
    /// Tokens scheduled (taken off the request's in-flight count when the output arrives).
    pub(super) num_scheduled: u32,
    /// The request's preemption count at scheduling: an output scheduled before a later
    /// preemption is stale (its tokens are delivered, its counters were reset).
    pub(super) preemptions: u32,
    /// Stale output to drop rather than deliver (set by `preempt_all_running`; see `pause.rs`).
    pub(super) drop_output: bool,
    /// The request's `is_prefill_chunk` before this step (restored if the step is abandoned).
    pub(super) was_prefill_chunk: bool,
    /// Admitted by this step (a new or resumed entry): abandoning the step un-admits it.
    pub(super) admitted: bool,
    /// The request's prefix-cached blocks before this step's allocation: abandoning the step
    /// withdraws the ones it registered (their KV is never computed).
    pub(super) cached_before: u32,
}

/// A planned step awaiting its model output: its entries in batch order.
#[derive(Debug, Clone)]
pub(super) struct InFlightStep {
    pub(super) step_id: u64,
    pub(super) entries: Vec<InFlightEntry>,
}
