//! Per-request state: tokens, block hashes, sampling stop rules, scheduling progress and blocks.

use smallvec::SmallVec;

use crate::hashing::{BlockHash, BlockHasher, ExtraKeys};
use crate::requests::kv_view::{RequestBlocks, SequenceView};

/// Draft tokens a request keeps without a heap allocation (K up to 15 needs 15).
pub const INLINE_DRAFTS: usize = 16;

/// At most this many output tokens are made room for when a request is submitted.
pub const OUTPUT_RESERVE_TOKENS: usize = 8192;

/// The token capacity a request is given at submission: its prompt plus the outputs it may
/// produce, up to `max_model_len` and at most `OUTPUT_RESERVE_TOKENS` of them (past that,
/// the vector doubles as usual). Callers that build the prompt vector can size it with this,
/// so that submission copies nothing.
pub fn token_capacity(num_prompt_tokens: usize, max_tokens: usize, max_model_len: usize) -> usize {
    let outputs = max_tokens
        .min(max_model_len.saturating_sub(num_prompt_tokens))
        .min(OUTPUT_RESERVE_TOKENS);
    num_prompt_tokens + outputs
}

/// Where a request is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// In the waiting queue, never run.
    Waiting,
    /// In the running list.
    Running,
    /// Back in the waiting queue after preemption (reported as resumed when readmitted).
    Preempted,
    /// Finished; the reason says why.
    Finished(FinishReason),
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop token.
    Stop,
    /// max_tokens or max_model_len reached.
    Length,
    /// Aborted by the engine.
    Abort,
    /// Ended by an error.
    Error,
}

impl FinishReason {
    /// The name used in outputs ("stop", "length", "abort", "error").
    pub fn name(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error => "error",
        }
    }
}

/// What the engine submits. A step does not read it: at submission its prompt moves into the
/// request's tokens and its stop rules into the request's [`StopRules`]; only the extra keys
/// are read again, when a block is hashed.
#[derive(Debug, Clone, Default)]
pub struct RequestSpec {
    /// Maximum output tokens.
    pub max_tokens: usize,
    /// No EOS/stop-token stop before this many output tokens.
    pub min_tokens: usize,
    /// EOS token, if the model has one.
    pub eos_token_id: Option<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Tokens that stop generation (reported as the stop reason).
    pub stop_token_ids: Vec<u32>,
    /// Prompt token ids.
    pub prompt_token_ids: Vec<u32>,
    /// LoRA adapter and cache salt, mixed into block hashes.
    pub extra: ExtraKeys,
    /// The LoRA adapter's id (vLLM's `lora_int_id`), 0 without one: admission keeps the
    /// adapters of a step's requests within [`crate::SchedulerConfig::max_loras`].
    pub lora_id: u32,
    /// Never read prefix-cache hits for this request (vLLM's `skip_reading_prefix_cache`, set
    /// for prompt logprobs: every prompt position must be computed); its blocks are still
    /// cached for others.
    pub skip_reading_prefix_cache: bool,
    /// Unique id.
    pub request_id: String,
    /// Lower value = more important (priority policy).
    pub priority: i64,
    /// Arrival time in seconds (priority tie-break).
    pub arrival_time: f64,
}

/// A request's stop rules, moved out of its [`RequestSpec`] at submission so that they sit in
/// the record's hot lines (every sampled token is checked against them).
#[derive(Debug, Clone, Default)]
#[repr(C)]
pub struct StopRules {
    /// Maximum output tokens.
    pub max_tokens: usize,
    /// No EOS/stop-token stop before this many output tokens.
    pub min_tokens: usize,
    /// Tokens that stop generation (reported as the stop reason).
    pub stop_token_ids: Box<[u32]>,
    /// EOS token, if the model has one.
    pub eos_token_id: Option<u32>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
}

impl StopRules {
    /// The first of `tokens` that stops the request (EOS unless ignored, or a stop token): its
    /// index, and the stop token if it is one (EOS is checked first).
    fn first_stop(&self, tokens: &[u32]) -> Option<(usize, Option<u32>)> {
        let eos = self.eos_token_id.filter(|_| !self.ignore_eos);
        if self.stop_token_ids.is_empty() {
            // The usual rules: one comparison per token, or none without EOS.
            let eos = eos?;
            return tokens.iter().position(|&t| t == eos).map(|i| (i, None));
        }
        tokens.iter().enumerate().find_map(|(i, &t)| {
            if eos == Some(t) {
                Some((i, None))
            } else if self.stop_token_ids.contains(&t) {
                Some((i, Some(t)))
            } else {
                None
            }
        })
    }

    /// Takes the rules out of `spec` (its `stop_token_ids` is left empty).
    fn take_from(spec: &mut RequestSpec) -> Self {
        Self {
            max_tokens: spec.max_tokens,
            min_tokens: spec.min_tokens,
            stop_token_ids: std::mem::take(&mut spec.stop_token_ids).into_boxed_slice(),
            eos_token_id: spec.eos_token_id,
            ignore_eos: spec.ignore_eos,
        }
    }
}

/// A request inside the scheduler.
///
/// Fields are laid out in declaration order (`repr(C)`), hottest first, for the slot record
/// that holds it (`request_store`, a line-aligned slot): line 0 holds the slot's generation and
/// row, the status and the counters; line 1 the token and block vectors; line 2 the stop rules;
/// lines 3-4 the drafts (their length word last, on line 4) and the block hashes (line 4).
/// Scheduling a running request reads lines 0-1 and the drafts' length; applying its output
/// lines 0-2 (and the hashes when it completes a block); what only admission or the API reads
/// comes last. A step touches every running request, so lines per request are what a
/// step costs once the engine's own work has evicted them (a test pins the lines).
#[derive(Debug, Clone)]
#[repr(C)]
pub struct Request {
    /// Lifecycle state.
    pub status: RequestStatus,
    /// Set at schedule time: the step ends before the known tokens, so its sample is discarded.
    pub is_prefill_chunk: bool,
    /// Times this request was preempted.
    pub num_preemptions: u32,
    /// Stop reason token when finished by a stop token.
    pub stop_token: Option<u32>,
    /// Tokens whose KV is computed (or being computed by the step in flight).
    pub num_computed_tokens: usize,
    /// Async scheduling: tokens the steps in flight will add (one sampled token plus the
    /// scheduled drafts per step), already counted in `num_computed_tokens`.
    pub num_output_placeholders: usize,
    /// Tokens scheduled in steps whose output is not applied yet (including steps scheduled
    /// before a preemption, whose output is stale).
    pub num_in_flight_tokens: usize,
    /// Prompt length: `tokens` starts with the prompt.
    pub num_prompt_tokens: usize,
    /// Prompt followed by accepted output tokens.
    pub tokens: Vec<u32>,
    /// Blocks held.
    pub blocks: RequestBlocks,
    /// When to stop.
    pub stop: StopRules,
    /// Draft tokens proposed for the next step, inline up to `INLINE_DRAFTS` so a step reads
    /// them from the request itself, not from one more heap line per request.
    pub spec_token_ids: SmallVec<[u32; INLINE_DRAFTS]>,
    /// Hashes of every full block of `tokens` (empty when caching is off).
    pub block_hashes: Vec<BlockHash>,
    /// What was submitted. Its `prompt_token_ids` moved into `tokens` (the prompt is kept
    /// once, as the first `num_prompt_tokens` of `tokens`) and its `stop_token_ids` into
    /// `stop`, which holds the stop rules.
    pub spec: RequestSpec,
    /// Submission order (FCFS and priority tie-break).
    pub arrival_seq: u64,
    /// Passed over at admission (`max_loras`, stale output in flight) and not admitted since:
    /// vLLM's `deferred_waiting`, reported as skipped waiting requests.
    pub deferred: bool,
    /// Held back from admission until released (vLLM's `WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR`:
    /// its grammar is still compiling); passed over at admission, keeping its place.
    pub admission_hold: bool,
}

impl Request {
    /// A waiting request; hashes its full prompt blocks when `hasher` is given.
    ///
    /// Its token and hash vectors get room for the outputs it may produce
    /// ([`token_capacity`]): decoding then appends without copying them as they grow, a copy
    /// of lines that are cold by then, repeated at every doubling.
    pub fn new(
        mut spec: RequestSpec,
        arrival_seq: u64,
        hasher: Option<&BlockHasher>,
        max_model_len: usize,
    ) -> Self {
        let mut tokens = std::mem::take(&mut spec.prompt_token_ids);
        let stop = StopRules::take_from(&mut spec);
        let num_prompt_tokens = tokens.len();
        let capacity = token_capacity(num_prompt_tokens, stop.max_tokens, max_model_len);
        tokens.reserve_exact(capacity.saturating_sub(tokens.len()));
        let mut block_hashes = Vec::new();
        if let Some(h) = hasher {
            block_hashes.reserve_exact(capacity / h.block_size().max(1));
            h.extend_hashes(&mut block_hashes, &tokens, &spec.extra);
        }
        Self {
            spec,
            stop,
            num_prompt_tokens,
            tokens,
            block_hashes,
            status: RequestStatus::Waiting,
            num_computed_tokens: 0,
            spec_token_ids: SmallVec::new(),
            blocks: RequestBlocks::default(),
            is_prefill_chunk: false,
            num_preemptions: 0,
            arrival_seq,
            stop_token: None,
            num_output_placeholders: 0,
            num_in_flight_tokens: 0,
            deferred: false,
            admission_hold: false,
        }
    }

    /// Known tokens (prompt + outputs).
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens a running request has yet to compute: its known tokens, drafts and output
    /// placeholders past those computed (before any cap of a step).
    pub fn num_tokens_to_compute(&self) -> usize {
        (self.num_tokens() + self.spec_token_ids.len() + self.num_output_placeholders)
            .saturating_sub(self.num_computed_tokens)
    }

    /// Prompt length.
    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    /// Prompt token ids.
    pub fn prompt_token_ids(&self) -> &[u32] {
        &self.tokens[..self.num_prompt_tokens]
    }

    /// Output tokens so far.
    pub fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// vLLM's async skip rule: the steps in flight reach `max_tokens` even if every draft they
    /// verify is rejected, so another step would only compute tokens that are dropped.
    pub fn in_flight_reaches_max_tokens(&self) -> bool {
        let ph = self.num_output_placeholders;
        ph > 0
            && self.num_computed_tokens + 2 >= ph + self.num_prompt_tokens() + self.stop.max_tokens
    }

    /// The view the KV-cache manager needs.
    pub fn sequence(&self) -> SequenceView<'_> {
        SequenceView {
            tokens: &self.tokens,
            block_hashes: &self.block_hashes,
            extra: &self.spec.extra,
        }
    }

    /// Replaces the draft tokens with `drafts`.
    pub(crate) fn set_drafts(&mut self, drafts: &[u32]) {
        if drafts.len() > INLINE_DRAFTS {
            self.spec_token_ids.clear();
            self.spec_token_ids.extend_from_slice(drafts);
            return;
        }
        // A few tokens, copied four at a time into an inline buffer: `extend_from_slice` would
        // make room with a zero-length move and copy with a call, which cost more.
        let mut buf = [0u32; INLINE_DRAFTS];
        let (whole, rest) = drafts.split_at(drafts.len() / 4 * 4);
        for (dst, src) in buf.chunks_exact_mut(4).zip(whole.chunks_exact(4)) {
            dst.copy_from_slice(src);
        }
        for (dst, &t) in buf[whole.len()..].iter_mut().zip(rest) {
            *dst = t;
        }
        self.spec_token_ids = SmallVec::from_buf_and_len(buf, drafts.len());
    }

    /// Whether the request has finished.
    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }

    /// Appends a step's sampled tokens up to and including the first one that stops the
    /// request, hashing the blocks they complete; returns how many were kept and why it
    /// stopped. The result of applying vLLM's stop rules token by token (a property test checks
    /// it against that reference), with the rules turned into positions: the length caps give
    /// the first position that ends it, `min_tokens` the first where a stop token counts, so
    /// only that range is scanned for EOS and stop tokens.
    pub fn append_outputs(
        &mut self,
        sampled: &[u32],
        max_model_len: usize,
        hasher: Option<&BlockHasher>,
    ) -> (usize, Option<FinishReason>) {
        let len = self.tokens.len();
        let num_output = len - self.num_prompt_tokens;
        // Token i makes len + i + 1 tokens and num_output + i + 1 outputs.
        let length_stop = max_model_len
            .saturating_sub(len + 1)
            .min(self.stop.max_tokens.saturating_sub(num_output + 1));
        let token_stops_from = self.stop.min_tokens.saturating_sub(num_output + 1);
        let scan_end = sampled.len().min(length_stop.saturating_add(1));
        let mut finish = None;
        let mut kept = sampled.len();
        let scanned = sampled.get(token_stops_from..scan_end).unwrap_or_default();
        if let Some((i, stop_token)) = self.stop.first_stop(scanned) {
            if stop_token.is_some() {
                self.stop_token = stop_token;
            }
            (kept, finish) = (token_stops_from + i + 1, Some(FinishReason::Stop));
        }
        if finish.is_none() && length_stop < sampled.len() {
            (kept, finish) = (length_stop + 1, Some(FinishReason::Length));
        }
        self.tokens.extend_from_slice(&sampled[..kept]);
        if let Some(h) = hasher {
            if h.hashes_more(len, self.tokens.len()) {
                h.extend_hashes(&mut self.block_hashes, &self.tokens, &self.spec.extra);
            }
        }
        (kept, finish)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's stop rules applied token by token, the reference `append_outputs` is checked
    /// against: append one token (hashing a newly full block), then, after `min_tokens`, EOS
    /// (unless ignored) and the stop tokens, then the length caps.
    fn append_token(
        r: &mut Request,
        token: u32,
        max_model_len: usize,
        hasher: &BlockHasher,
    ) -> Option<FinishReason> {
        r.tokens.push(token);
        if r.tokens.len() >= hasher.lookahead()
            && (r.tokens.len() - hasher.lookahead()) % hasher.block_size() == 0
        {
            hasher.extend_hashes(&mut r.block_hashes, &r.tokens, &r.spec.extra);
        }
        let num_output = r.num_output_tokens();
        if num_output >= r.stop.min_tokens {
            if !r.stop.ignore_eos && r.stop.eos_token_id == Some(token) {
                return Some(FinishReason::Stop);
            }
            if r.stop.stop_token_ids.contains(&token) {
                r.stop_token = Some(token);
                return Some(FinishReason::Stop);
            }
        }
        if r.tokens.len() >= max_model_len || num_output >= r.stop.max_tokens {
            return Some(FinishReason::Length);
        }
        None
    }

    fn spec(prompt_len: usize, max_tokens: usize) -> RequestSpec {
        RequestSpec {
            request_id: "r".into(),
            prompt_token_ids: (0..prompt_len as u32).collect(),
            max_tokens,
            stop_token_ids: vec![7],
            ..Default::default()
        }
    }

    proptest::proptest! {
        /// `append_outputs` keeps the same tokens, stops for the same reason and hashes the
        /// same blocks as appending the tokens one by one with `append_token`.
        #[test]
        fn append_outputs_matches_token_by_token(
            prompt_len in 1usize..40,
            outputs_before in 0usize..12,
            max_tokens in 1usize..30,
            min_tokens in 0usize..20,
            max_model_len in 1usize..80,
            eos in proptest::option::of(0u32..6),
            ignore_eos in proptest::bool::ANY,
            stop_ids in proptest::collection::vec(0u32..6, 0..3),
            sampled in proptest::collection::vec(0u32..8, 1..10),
            hash_lookahead in 0usize..3,
        ) {
            let hasher = BlockHasher::new(crate::hashing::HashAlgo::Sha256, 4, b"")
                .with_lookahead(hash_lookahead);
            let mut r = Request::new(
                RequestSpec {
                    request_id: "r".into(),
                    prompt_token_ids: (100..100 + prompt_len as u32).collect(),
                    max_tokens,
                    min_tokens,
                    eos_token_id: eos,
                    ignore_eos,
                    stop_token_ids: stop_ids,
                    ..Default::default()
                },
                0,
                Some(&hasher),
                max_model_len,
            );
            r.tokens.extend((0..outputs_before as u32).map(|t| 50 + t));
            r.block_hashes.clear();
            hasher.extend_hashes(&mut r.block_hashes, &r.tokens, &r.spec.extra);
            let mut expected = r.clone();
            let mut want = (0, None);
            for &t in &sampled {
                want.0 += 1;
                want.1 = append_token(&mut expected, t, max_model_len, &hasher);
                if want.1.is_some() {
                    break;
                }
            }
            let got = r.append_outputs(&sampled, max_model_len, Some(&hasher));
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(&r.tokens, &expected.tokens);
            proptest::prop_assert_eq!(&r.block_hashes, &expected.block_hashes);
            proptest::prop_assert_eq!(r.stop_token, expected.stop_token);
        }
    }

    #[test]
    fn token_capacity_is_capped_by_the_model_and_the_reserve() {
        assert_eq!(token_capacity(10, 100, 1000), 110);
        assert_eq!(token_capacity(10, 100, 50), 50);
        assert_eq!(
            token_capacity(10, 1 << 20, 1 << 30),
            10 + OUTPUT_RESERVE_TOKENS
        );
        assert_eq!(token_capacity(60, 100, 50), 60); // over-long prompts are rejected later
    }

    #[test]
    fn decoding_within_the_reserve_never_moves_the_vectors() {
        let hasher = BlockHasher::new(crate::hashing::HashAlgo::Sha256, 16, b"");
        let mut r = Request::new(spec(30, 200), 0, Some(&hasher), 4096);
        assert!(r.stop.stop_token_ids.as_ref() == [7] && r.spec.stop_token_ids.is_empty());
        let (tokens, hashes) = (r.tokens.as_ptr(), r.block_hashes.as_ptr());
        for t in 0..199 {
            assert_eq!(r.append_outputs(&[100 + t], 4096, Some(&hasher)), (1, None));
        }
        assert_eq!(r.block_hashes.len(), 229 / 16);
        assert_eq!(
            (r.tokens.as_ptr(), r.block_hashes.as_ptr()),
            (tokens, hashes)
        );
        assert_eq!(
            r.append_outputs(&[1], 4096, Some(&hasher)),
            (1, Some(FinishReason::Length))
        );
    }
}
