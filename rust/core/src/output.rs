//! What one `schedule()` call produces and what one `update_from_output()` call returns, as
//! flat vectors in batch order (the bindings turn them into numpy arrays without per-block
//! Python objects).

use crate::requests::request::FinishReason;

/// How a scheduled request entered this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EntryKind {
    /// Was running before this step.
    Running,
    /// Admitted for the first time.
    New,
    /// Readmitted after preemption.
    Resumed,
}

/// One step's schedule. Entry `i` is row `i` of the block table.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// Identifies the step; `update_from_output` must be given the same id.
    pub step_id: u64,
    /// The scheduler that produced this step.
    pub scheduler_uid: u64,
    /// Request slot of each batch entry.
    pub slots: Vec<u32>,
    /// How each entry entered the step.
    pub kinds: Vec<EntryKind>,
    /// Tokens scheduled per entry (prompt chunk, or 1 + drafts).
    pub num_scheduled_tokens: Vec<i32>,
    /// Computed tokens per entry before this step (prefix hits included).
    pub num_computed_tokens: Vec<i32>,
    /// Async scheduling: output placeholders per entry before this step (tokens of earlier
    /// steps in flight that the request has not received yet); 0 otherwise.
    pub num_output_placeholders: Vec<u32>,
    /// Prefix sums of `num_scheduled_tokens` (length entries + 1).
    pub query_start_loc: Vec<i32>,
    /// True where the step ends before the request's known tokens.
    pub is_prefill_chunk: Vec<bool>,
    /// Blocks the runner has not seen yet, flat: this step's new blocks for running entries,
    /// every block for new and resumed ones.
    pub new_block_ids: Vec<u32>,
    /// Per-entry count of `new_block_ids`.
    pub num_new_blocks: Vec<u32>,
    /// Generation of each entry's slot (identifies the request without an id lookup).
    pub generations: Vec<u32>,
    /// Draft tokens scheduled for verification, flat, with per-entry counts.
    pub spec_token_ids: Vec<u32>,
    /// Per-entry number of scheduled draft tokens.
    pub num_spec_tokens: Vec<u32>,
    /// Lookahead slots allocated past the scheduled tokens.
    pub num_lookahead_tokens: usize,
    /// Requests that finished since the previous step.
    pub finished_req_ids: Vec<String>,
    /// Requests preempted in this step.
    pub preempted_req_ids: Vec<String>,
    /// Sum of `num_scheduled_tokens`.
    pub total_num_scheduled_tokens: usize,
}

impl StepOutput {
    /// Number of scheduled requests.
    pub fn num_reqs(&self) -> usize {
        self.slots.len()
    }

    /// Makes room for `n` more entries in the per-entry columns that `schedule()` fills one
    /// entry at a time (`query_start_loc` one more).
    pub(crate) fn reserve_entries(&mut self, n: usize) {
        self.num_scheduled_tokens.reserve(n);
        self.num_computed_tokens.reserve(n);
        self.num_spec_tokens.reserve(n);
        self.query_start_loc.reserve(n + 1);
        self.num_output_placeholders.reserve(n);
        self.is_prefill_chunk.reserve(n);
        self.num_new_blocks.reserve(n);
        self.generations.reserve(n);
    }

    /// Clears every vector, keeping capacity.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.kinds.clear();
        self.num_scheduled_tokens.clear();
        self.num_computed_tokens.clear();
        self.num_output_placeholders.clear();
        self.query_start_loc.clear();
        self.is_prefill_chunk.clear();
        self.new_block_ids.clear();
        self.num_new_blocks.clear();
        self.generations.clear();
        self.spec_token_ids.clear();
        self.num_spec_tokens.clear();
        self.finished_req_ids.clear();
        self.preempted_req_ids.clear();
        self.total_num_scheduled_tokens = 0;
    }
}

/// The effect of one model output on one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestUpdate {
    /// Request slot.
    pub slot: u32,
    /// Range of this request's new tokens in `UpdateOutput::new_token_ids`.
    pub tokens_start: u32,
    /// End of that range.
    pub tokens_end: u32,
    /// Set when the request finished in this update.
    pub finish_reason: Option<FinishReason>,
    /// The stop token, when a stop token ended it.
    pub stop_token: Option<u32>,
}

/// A request the scheduler ended on its own outside an update (one the pool can never hold),
/// reported by the next `update_from_output`, as an update reports a stop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedRequest {
    /// The request's id (its slot may already serve another request).
    pub request_id: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
}

/// What `update_from_output` produced.
#[derive(Debug, Clone, Default)]
pub struct UpdateOutput {
    /// Per-request effects, in batch order (requests gone meanwhile are skipped).
    pub updates: Vec<RequestUpdate>,
    /// Accepted new tokens of every request, flat.
    pub new_token_ids: Vec<u32>,
    /// Requests the scheduler ended on its own since the previous update, each reported once,
    /// in the order they ended. They have no entry in `updates`.
    pub ended: Vec<EndedRequest>,
}
