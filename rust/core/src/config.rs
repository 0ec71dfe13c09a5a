//! Scheduler configuration and its validation.

use crate::error::{invalid, CoreResult};
use crate::hashing::HashAlgo;
use crate::limits;
use crate::lookahead::{LookaheadPolicy, SpecMethod};
use crate::requests::queue::Policy;
use crate::semantics::VllmSemantics;

/// Everything that shapes scheduling and allocation.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Blocks in the pool, null block included.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Longest sequence (prompt + output) a request may reach.
    pub max_model_len: usize,
    /// Most requests running at once (rows of the block table).
    pub max_num_seqs: usize,
    /// Token budget of one step.
    pub max_num_batched_tokens: usize,
    /// Prefix caching on/off.
    pub enable_prefix_caching: bool,
    /// Split prompts over several steps when the budget is short.
    pub enable_chunked_prefill: bool,
    /// Cap on tokens per request per step (0 = none).
    pub long_prefill_token_threshold: usize,
    /// FCFS or priority.
    pub policy: Policy,
    /// Speculative decoding method.
    pub spec_method: SpecMethod,
    /// K, the number of speculative tokens.
    pub num_speculative_tokens: usize,
    /// Block-hash function.
    pub hash_algo: HashAlgo,
    /// Seed of the block-hash root.
    pub hash_seed: Vec<u8>,
    /// Lookahead rule (only `Correct` outside tests).
    pub lookahead_policy: LookaheadPolicy,
    /// Verify prefix-cache hits against the tokens and prefix they were cached with (default);
    /// false trusts the block hash alone, as vLLM does (a test switch, see `provenance`).
    pub verify_prefix_hits: bool,
    /// vLLM 0.33's padding of an admitted request with one token left (a resume, a full
    /// prefix hit) to 1 + K tokens with K placeholder drafts when it joins a decode batch.
    /// Off by default; the vLLM drop-in turns it on.
    pub pad_admitted_decodes: bool,
    /// vLLM's async scheduling (its `AsyncScheduler`): the next step is scheduled before the
    /// previous one's output arrives, counting that output ahead as placeholders (one sampled
    /// token plus the scheduled drafts per request, and K placeholder drafts for the next step).
    pub async_scheduling: bool,
    /// Input slots each scheduled request takes from the step's token budget on top of its
    /// scheduled tokens (vLLM's `max_num_new_slots_for_drafting`: K for DFlash in vLLM 0.32,
    /// 0 for every supported method in 0.33). 0 by default.
    pub draft_slots_per_request: usize,
    /// Give back the last block of every prefix-cache hit, so its tokens are recomputed
    /// (vLLM's EAGLE block drop, its default for EAGLE/EAGLE3/MTP, and for DFlash in 0.32).
    /// Off by default.
    pub drop_last_hit_block: bool,
    /// Tokens after each block that its hash also covers (vLLM 0.33's lookahead block hashes,
    /// its default for EAGLE/EAGLE3/MTP with prefix caching: a drafter's KV at a block's last
    /// position depends on the next token, so a block is reusable only after the same next
    /// token). A block is hashed, and so cached, once those tokens exist. Replaces the last
    /// block drop. 0 (the default) hashes each block alone.
    pub hash_lookahead_tokens: usize,
    /// Keep a log of prefix-cache changes (`pool::kv_events`) for the engine to publish as
    /// KV-cache events (vLLM's `--kv-events-config`). Off by default.
    pub kv_events: bool,
    /// The vLLM release series followed where their schedulers differ (0.33 by default).
    pub vllm_semantics: VllmSemantics,
    /// Refuse a pool that cannot hold one `max_model_len` request (default), as vLLM's engine
    /// does at startup. False accepts it, as vLLM's `Scheduler` class does (and its engine with
    /// `num_gpu_blocks_override`): a request that outgrows such a pool alone is ended with
    /// [`crate::FinishReason::Error`]. The vLLM drop-in turns it off.
    pub pool_must_hold_max_model_len: bool,
    /// Refuse an idle `schedule()` while as many steps await output as the mode allows
    /// (default): everything runnable waits for those outputs, a misuse that would otherwise
    /// return empty steps forever. False returns the empty step, as vLLM's `Scheduler` class
    /// does (the vLLM drop-in turns it off: vLLM's engine decides how many steps it keeps in
    /// flight).
    pub refuse_idle_steps: bool,
    /// Most LoRA adapters among one step's requests (vLLM's `max_loras`): a waiting request
    /// with another adapter is passed over while that many are scheduled. 0: no limit.
    pub max_loras: usize,
    /// vLLM 0.33's local prefill cadence (its `prefill_schedule_interval` without DP
    /// coordination): prefills wait until this many executed steps have passed since the last
    /// step that carried one, so decodes run alone in between (see `scheduler/cadence.rs`).
    /// 1 (the default) holds nothing back.
    pub local_prefill_interval: usize,
}

impl SchedulerConfig {
    /// A config with vLLM-like defaults for the given pool and limits.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
    ) -> Self {
        Self {
            num_blocks,
            block_size,
            max_model_len,
            max_num_seqs,
            max_num_batched_tokens,
            enable_prefix_caching: true,
            enable_chunked_prefill: true,
            long_prefill_token_threshold: 0,
            policy: Policy::Fcfs,
            spec_method: SpecMethod::None,
            num_speculative_tokens: 0,
            hash_algo: HashAlgo::Sha256,
            hash_seed: b"dflash-rs".to_vec(),
            lookahead_policy: LookaheadPolicy::Correct,
            verify_prefix_hits: true,
            pad_admitted_decodes: false,
            async_scheduling: false,
            draft_slots_per_request: 0,
            drop_last_hit_block: false,
            hash_lookahead_tokens: 0,
            kv_events: false,
            vllm_semantics: VllmSemantics::V0_33,
            pool_must_hold_max_model_len: true,
            refuse_idle_steps: true,
            max_loras: 0,
            local_prefill_interval: 1,
        }
    }

    /// Rejects inconsistent settings, and settings beyond the bounds of `limits`
    /// (int32 fields; tables allocated up front within the machine's memory), before anything
    /// is allocated.
    pub fn validate(&self) -> CoreResult<()> {
        self.validate_fields()?;
        self.validate_pool()?;
        limits::check_scheduler_memory(
            self.num_blocks,
            self.block_size,
            self.max_model_len,
            self.max_num_seqs,
            self.enable_prefix_caching,
        )
    }

    /// Blocks a pool needs to hold one request of `max_model_len` tokens: its
    /// `cdiv(max_model_len, block_size)` blocks plus the null block. The lookahead needs none
    /// more: every allocation stops at `max_model_len`, lookahead slots included.
    pub fn min_num_blocks(&self) -> usize {
        self.block_table_width() + 1
    }

    /// Refuses a pool that cannot hold one `max_model_len` request, as vLLM does at startup: a
    /// request that grows to `max_model_len` would never fit, not even alone (unless
    /// `pool_must_hold_max_model_len` is off).
    fn validate_pool(&self) -> CoreResult<()> {
        let needed = self.min_num_blocks();
        if self.pool_must_hold_max_model_len && self.num_blocks < needed {
            return Err(invalid!(
                "num_blocks ({}) cannot hold one request of max_model_len ({}) tokens: that needs \
                 cdiv({}, block_size {}) = {} blocks plus the null block, {needed} in all; raise \
                 num_blocks or lower max_model_len",
                self.num_blocks,
                self.max_model_len,
                self.max_model_len,
                self.block_size,
                needed - 1
            ));
        }
        Ok(())
    }

    fn validate_fields(&self) -> CoreResult<()> {
        if self.num_blocks < 2 {
            return Err(invalid!(
                "num_blocks must be at least 2 (block 0 is reserved), got {}",
                self.num_blocks
            ));
        }
        if self.block_size == 0 {
            return Err(invalid!("block_size must be positive"));
        }
        if self.max_model_len < 2 {
            return Err(invalid!(
                "max_model_len must be at least 2, got {}",
                self.max_model_len
            ));
        }
        if self.max_num_seqs == 0 {
            return Err(invalid!("max_num_seqs must be positive"));
        }
        if self.max_num_batched_tokens == 0 {
            return Err(invalid!("max_num_batched_tokens must be positive"));
        }
        if !(1..=i32::MAX as usize).contains(&self.local_prefill_interval) {
            return Err(invalid!(
                "local_prefill_interval must be in [1, 2**31 - 1] (1: no prefill cadence), got {}",
                self.local_prefill_interval
            ));
        }
        for (field, value) in [
            ("num_blocks", self.num_blocks),
            ("block_size", self.block_size),
            ("max_model_len", self.max_model_len),
            ("max_num_seqs", self.max_num_seqs),
            ("max_num_batched_tokens", self.max_num_batched_tokens),
        ] {
            limits::check_int32(field, value)?;
        }
        if self.draft_slots_per_request >= self.max_num_batched_tokens {
            return Err(invalid!(
                "draft_slots_per_request ({}) must be below max_num_batched_tokens ({}): no \
                 request could be scheduled",
                self.draft_slots_per_request,
                self.max_num_batched_tokens
            ));
        }
        if !self.enable_chunked_prefill && self.max_num_batched_tokens < self.max_model_len {
            // A prompt longer than the budget could never be scheduled in one step.
            return Err(invalid!(
                "without chunked prefill, max_num_batched_tokens ({}) must be >= max_model_len ({})",
                self.max_num_batched_tokens,
                self.max_model_len
            ));
        }
        let spec = self.spec_method != SpecMethod::None;
        if spec && self.num_speculative_tokens == 0 {
            return Err(invalid!(
                "num_speculative_tokens must be >= 1 for method {}",
                self.spec_method.name()
            ));
        }
        if !spec && self.num_speculative_tokens != 0 {
            return Err(invalid!(
                "num_speculative_tokens must be 0 without a speculative method"
            ));
        }
        if self.num_speculative_tokens > 64 {
            return Err(invalid!(
                "num_speculative_tokens {} is above 64",
                self.num_speculative_tokens
            ));
        }
        if self.hash_lookahead_tokens > 64 {
            return Err(invalid!(
                "hash_lookahead_tokens {} is above 64",
                self.hash_lookahead_tokens
            ));
        }
        if self.hash_lookahead_tokens > 0 && self.drop_last_hit_block {
            return Err(invalid!(
                "hash_lookahead_tokens and drop_last_hit_block exclude each other: lookahead \
                 hashes make the last hit block reusable, the drop recomputes it"
            ));
        }
        Ok(())
    }

    /// Columns of the block table: enough blocks for `max_model_len` positions.
    pub fn block_table_width(&self) -> usize {
        self.max_model_len.div_ceil(self.block_size)
    }

    /// Lookahead the contract requires (the correct table), whatever policy is in use.
    pub fn required_lookahead(&self) -> usize {
        self.spec_method
            .required_lookahead(self.num_speculative_tokens)
    }
}
