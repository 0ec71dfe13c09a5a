//! `scheduler_ops`: random operation sequences on [`Scheduler`] over random configurations
//! (block size, tiny pools that force preemption, FCFS or priority, every speculative method
//! with K in 0..=15, chunked prefill on or off, prefix caching on or off, per-request prefill
//! caps), driven as `rust/core/tests/scheduler_ownership.rs` and an engine drive it:
//! `add_request` (shared prefixes, and edge cases: empty, exactly or past `max_model_len`,
//! larger than the pool, duplicate or empty ids, NaN arrival times), `schedule`,
//! `update_from_output` (random acceptance, EOS and stop tokens, and invalid outputs: stale or
//! future step ids, wrong counts, too many tokens, no token for a decode with drafts), lost
//! outputs (`abandon_step`, then the abandoned output refused), draft tokens by id or by slot,
//! aborts and prefix-cache resets.
//!
//! Checked after every operation: `Scheduler::check_invariants` (pool accounting and ref counts,
//! queues, block-table rows, the ownership contract with the method's required lookahead). After
//! every `schedule()`: the contract again from the step output and block table alone (every
//! position a scheduled request's target or drafter writes maps to a block it owns), the token
//! budget, `max_num_seqs`, and the output's internal consistency. Calls that fail must change
//! nothing; valid calls (`schedule`, a well-formed `update_from_output`) must not fail.
//!
//! At the end the harness aborts requests it starved on purpose and runs the engine loop with
//! well-formed outputs until every request has finished: a scheduler that can no longer make
//! progress (a step that schedules, preempts and finishes nothing while requests remain) or
//! that does not finish within a generous step bound is a finding.

use std::collections::{HashSet, VecDeque};
use std::hash::{DefaultHasher, Hash, Hasher};

use arbitrary::{Arbitrary, Unstructured};
use dflash_core::{
    CoreError, CoreResult, EntryKind, ExtraKeys, FinishReason, HashAlgo, Policy, RequestSpec,
    Scheduler, SchedulerConfig, SpecMethod, StepOutput, UpdateOutput,
};

use crate::{prompt_tokens, Lcg};

/// Operations decoded from one input at most.
pub const MAX_OPS: usize = 192;
/// Distinct request ids.
const NUM_IDS: u8 = 20;
const BLOCK_SIZES: [usize; 6] = [1, 2, 4, 8, 16, 3];
const METHODS: [SpecMethod; 8] = [
    SpecMethod::None,
    SpecMethod::DFlash,
    SpecMethod::Eagle,
    SpecMethod::Eagle3,
    SpecMethod::Mtp,
    SpecMethod::DraftModel,
    SpecMethod::Ngram,
    SpecMethod::Suffix,
];
const EOS: u32 = 1;
const STOP: u32 = 2;

/// The scheduler's configuration, decoded.
#[derive(Arbitrary, Debug, Clone)]
pub struct SchedConfig {
    num_blocks: u8,
    block_size: u8,
    max_model_len: u8,
    max_num_seqs: u8,
    budget: u8,
    /// bit 0: prefix caching off; bit 1: chunked prefill off; bit 2: priority policy;
    /// bit 3: a long-prefill threshold.
    flags: u8,
    threshold: u8,
    method: u8,
    k: u8,
    algo: u8,
}

/// A prompt length, with the edge cases spelled out.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Len {
    /// A short prompt.
    Short(u8),
    /// `n` blocks plus or minus a few tokens.
    Blocks(u8, i8),
    /// `max_model_len` plus or minus a few tokens.
    MaxModelLen(i8),
    /// The whole pool's token capacity plus or minus a few tokens.
    Pool(i8),
    /// Empty.
    Zero,
}

/// Arrival time of a request (the priority tie-break).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Arrival {
    /// 0.0
    Zero,
    /// A finite value.
    Val(i16),
    /// NaN (must be refused).
    NaN,
    /// Infinity (must be refused).
    Inf,
}

/// How an output is handed back.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum UpdateMode {
    /// Well formed, for the oldest step in flight.
    Valid,
    /// A step already applied.
    Stale,
    /// A step not scheduled yet.
    Future,
    /// One count too many.
    CountMismatch,
    /// Counts and tokens disagree.
    SumMismatch,
    /// More tokens than 1 + drafts for an entry.
    OverCount,
    /// No token for an entry that verified drafts (refused: a decode samples at least one).
    EmptyDraftedDecode,
    /// The output is lost (the runner raised): the step is abandoned, then its output refused.
    Lost,
}

/// One operation.
#[derive(Arbitrary, Debug, Clone)]
pub enum SchedOp {
    /// Submit a request.
    Add {
        id: u8,
        len: Len,
        template: u8,
        prefix_frac: u8,
        seed: u8,
        max_tokens: u8,
        min_tokens: u8,
        eos: bool,
        stop: bool,
        ignore_eos: bool,
        priority: i8,
        arrival: Arrival,
        lora: Option<bool>,
        salt: Option<bool>,
    },
    /// Plan a step (when no step is in flight).
    Schedule,
    /// Apply the model output of the oldest step in flight (or an invalid one).
    Update {
        mode: UpdateMode,
        accept: Vec<u8>,
        seed: u8,
    },
    /// Draft tokens for running requests.
    Drafts {
        n: u8,
        by_slots: bool,
        bad_counts: bool,
        seed: u8,
    },
    /// Finish a request by id (abort, or another reason).
    Finish { id: u8, reason: u8 },
    /// Empty the prefix cache.
    Reset,
}

/// The whole input.
#[derive(Debug, Clone)]
pub struct SchedInput {
    /// The configuration.
    pub config: SchedConfig,
    /// Operations in order.
    pub ops: Vec<SchedOp>,
}

impl SchedInput {
    /// Decodes as much as the bytes give.
    pub fn decode(data: &[u8]) -> Self {
        let mut u = Unstructured::new(data);
        let config = SchedConfig::arbitrary(&mut u).unwrap_or(SchedConfig {
            num_blocks: 0,
            block_size: 0,
            max_model_len: 0,
            max_num_seqs: 0,
            budget: 0,
            flags: 0,
            threshold: 0,
            method: 0,
            k: 0,
            algo: 0,
        });
        let mut ops = Vec::new();
        while !u.is_empty() && ops.len() < MAX_OPS {
            match SchedOp::arbitrary(&mut u) {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        Self { config, ops }
    }
}

/// What a run did (for the seed generator and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedStats {
    /// Requests accepted by `add_request`.
    pub added: u32,
    /// Requests refused by `add_request`.
    pub refused: u32,
    /// Non-empty steps.
    pub steps: u32,
    /// Preemptions.
    pub preemptions: u64,
    /// Draft tokens accepted.
    pub accepted_drafts: u64,
    /// Requests finished (any reason).
    pub finished: u64,
    /// Prefix-cache hit tokens.
    pub hit_tokens: u64,
    /// Invalid calls refused as expected.
    pub refused_calls: u32,
    /// Steps abandoned (their output lost).
    pub abandoned: u32,
    /// Steps of the final drain.
    pub drain_steps: u32,
    /// Known findings tolerated (`DFLASH_FUZZ_ALLOW`).
    pub tolerated: u32,
}

/// Builds the configuration; the method, K and pool are always valid.
pub fn build_config(c: &SchedConfig) -> SchedulerConfig {
    let bs = BLOCK_SIZES[usize::from(c.block_size) % BLOCK_SIZES.len()];
    let num_blocks = 2 + usize::from(c.num_blocks % 48);
    let max_model_len = 2 + usize::from(c.max_model_len % 160);
    let max_num_seqs = 1 + usize::from(c.max_num_seqs % 8);
    let budget = match c.budget % 4 {
        0 => 1 + usize::from(c.budget / 4 % 16),
        _ => 1 + usize::from(c.budget) * 2,
    };
    let mut config = SchedulerConfig::new(num_blocks, bs, max_model_len, max_num_seqs, budget);
    // The harness explores pools smaller than one max_model_len request too (vLLM's Scheduler
    // class semantics, which the vLLM drop-in follows), where a request can outgrow the pool.
    config.pool_must_hold_max_model_len = false;
    config.enable_prefix_caching = c.flags & 1 == 0;
    config.enable_chunked_prefill = c.flags & 2 == 0;
    if !config.enable_chunked_prefill {
        // Without chunking, every prompt must fit one step (the config is refused otherwise).
        config.max_num_batched_tokens = config.max_num_batched_tokens.max(max_model_len);
    }
    config.policy = if c.flags & 4 != 0 {
        Policy::Priority
    } else {
        Policy::Fcfs
    };
    if c.flags & 8 != 0 {
        config.long_prefill_token_threshold = 1 + usize::from(c.threshold % 64);
    }
    config.spec_method = METHODS[usize::from(c.method) % METHODS.len()];
    config.num_speculative_tokens = if config.spec_method == SpecMethod::None {
        0
    } else {
        1 + usize::from(c.k % 15)
    };
    // `TestCollide` (dflash-core feature `fault-injection`) hashes every block alike: only hit
    // verification keeps prefixes apart. Verification is on three times in four.
    config.hash_algo = [
        HashAlgo::Xxh3_128,
        HashAlgo::Sha256,
        HashAlgo::Blake3,
        HashAlgo::TestCollide,
    ][usize::from(c.algo % 4)];
    config.verify_prefix_hits = !(c.algo >> 2).is_multiple_of(4);
    config
}

/// A model output for one step.
struct Output {
    tokens: Vec<u32>,
    counts: Vec<u32>,
    /// Requests given an empty sample for a decode step (they can never be scheduled again).
    starved: Vec<String>,
}

struct Harness {
    allow: crate::Allow,
    sched: Scheduler,
    config: SchedulerConfig,
    required: usize,
    /// Outputs of scheduled, non-empty steps awaiting their model output, oldest first.
    pending: VecDeque<StepOutput>,
    /// The latest non-empty step (for drafts by slot).
    last: Option<StepOutput>,
    /// Requests the harness starved on purpose (an empty sample for a decode step).
    starved: HashSet<String>,
    out: StepOutput,
    upd: UpdateOutput,
    stats: SchedStats,
    /// Prefix identity (see `truth_of`) of the KV each cached block holds, by block id.
    content: Vec<Option<u64>>,
    /// Whether prefix hits must be exact: with hit verification, or without a forced collision.
    exact_hits: bool,
}

/// Identity of each full block's prefix (tokens through the end of the block, LoRA, salt),
/// computed independently of the core's hashers.
fn truth_of(tokens: &[u32], extra: &ExtraKeys, bs: usize) -> Vec<u64> {
    let mut truth: Vec<u64> = Vec::with_capacity(tokens.len() / bs);
    for block in tokens.chunks_exact(bs) {
        let mut h = DefaultHasher::new();
        truth.last().hash(&mut h);
        block.hash(&mut h);
        extra.lora_name.hash(&mut h);
        extra.cache_salt.hash(&mut h);
        truth.push(h.finish());
    }
    truth
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) -> SchedStats {
    run_with(data, crate::Allow::from_env())
}

/// Runs one input, tolerating the known findings in `allow`; panics on any other finding.
pub fn run_with(data: &[u8], allow: &crate::Allow) -> SchedStats {
    run_input_with(&SchedInput::decode(data), allow)
}

/// Runs a decoded input strictly (every finding is a panic).
pub fn run_input(input: &SchedInput) -> SchedStats {
    run_input_with(input, &crate::Allow::none())
}

/// Runs a decoded input, tolerating the known findings in `allow`.
pub fn run_input_with(input: &SchedInput, allow: &crate::Allow) -> SchedStats {
    let config = build_config(&input.config);
    let num_blocks = config.num_blocks;
    let exact_hits = config.verify_prefix_hits || config.hash_algo != HashAlgo::TestCollide;
    let sched = match Scheduler::new(config.clone()) {
        Ok(s) => s,
        Err(e) => panic!("Scheduler::new refused a valid config {config:?}: {e}"),
    };
    let mut h = Harness {
        allow: allow.clone(),
        required: config.required_lookahead(),
        sched,
        config,
        pending: VecDeque::new(),
        last: None,
        starved: HashSet::new(),
        out: StepOutput::default(),
        upd: UpdateOutput::default(),
        stats: SchedStats::default(),
        content: vec![None; num_blocks],
        exact_hits,
    };
    h.check("new");
    for (i, op) in input.ops.iter().enumerate() {
        h.apply(op);
        h.check(&format!("op {i} {op:?}"));
    }
    h.drain();
    let s = h.sched.stats();
    h.stats.preemptions = s.num_preemptions;
    h.stats.accepted_drafts = s.num_accepted_tokens;
    h.stats.finished = s.num_finished;
    h.stats.hit_tokens = h.sched.prefix_cache_stats().hits;
    h.stats
}

fn request_id(id: u8) -> String {
    if id == u8::MAX {
        String::new() // must be refused
    } else {
        format!("r{}", id % NUM_IDS)
    }
}

impl Harness {
    fn snapshot(&self) -> String {
        format!("{:?}", self.sched)
    }

    fn apply(&mut self, op: &SchedOp) {
        match *op {
            SchedOp::Add {
                id,
                len,
                template,
                prefix_frac,
                seed,
                max_tokens,
                min_tokens,
                eos,
                stop,
                ignore_eos,
                priority,
                arrival,
                lora,
                salt,
            } => {
                let bs = self.config.block_size;
                let mml = self.config.max_model_len;
                let pool_tokens = (self.config.num_blocks - 1) * bs;
                let n = match len {
                    Len::Short(n) => usize::from(n % 48),
                    Len::Blocks(b, d) => {
                        (usize::from(b % 12) * bs).saturating_add_signed(isize::from(d % 4))
                    }
                    Len::MaxModelLen(d) => mml.saturating_add_signed(isize::from(d % 3)),
                    Len::Pool(d) => pool_tokens.saturating_add_signed(isize::from(d % 3)),
                    Len::Zero => 0,
                }
                .min(1024);
                let prefix = n * usize::from(prefix_frac) / 255;
                let spec = RequestSpec {
                    request_id: request_id(id),
                    prompt_token_ids: prompt_tokens(template, prefix, n - prefix, u32::from(seed)),
                    max_tokens: usize::from(max_tokens % 40),
                    eos_token_id: eos.then_some(EOS),
                    stop_token_ids: if stop { vec![STOP] } else { Vec::new() },
                    ignore_eos,
                    min_tokens: usize::from(min_tokens % 8),
                    priority: i64::from(priority % 4),
                    arrival_time: match arrival {
                        Arrival::Zero => 0.0,
                        Arrival::Val(v) => f64::from(v) / 8.0,
                        Arrival::NaN => f64::NAN,
                        Arrival::Inf => f64::INFINITY,
                    },
                    lora_id: lora.map_or(0, |b| if b { 1 } else { 2 }),
                    skip_reading_prefix_cache: false,
                    extra: ExtraKeys {
                        lora_name: lora.map(|b| if b { "a" } else { "b" }.to_owned()),
                        cache_salt: salt.map(|b| if b { "x" } else { "y" }.to_owned()),
                        ..Default::default()
                    },
                };
                let before = self.snapshot();
                let live = self.sched.slot_of(&spec.request_id).is_some();
                let valid = !spec.request_id.is_empty()
                    && !live
                    && n > 0
                    && n <= mml
                    // The prompt and the admission lookahead fit the whole pool.
                    && (n + self.required).min(mml).div_ceil(bs) < self.config.num_blocks
                    && spec.max_tokens > 0
                    && spec.arrival_time.is_finite();
                match self.sched.add_request(spec.clone()) {
                    Ok(_) => {
                        assert!(valid, "add_request accepted an invalid request {spec:?}");
                        self.stats.added += 1;
                    }
                    Err(e) => {
                        assert!(!valid, "add_request refused a valid request: {e}");
                        assert_eq!(before, self.snapshot(), "failed add_request changed state");
                        self.stats.refused += 1;
                    }
                }
            }
            // Synchronous engine loop (async mode is not fuzzed here): a step is planned
            // only once the previous one's output was applied, and drafts come in between.
            SchedOp::Schedule => {
                if self.pending.is_empty() {
                    self.schedule("schedule op");
                }
            }
            SchedOp::Update {
                mode,
                ref accept,
                seed,
            } => self.update(mode, accept, seed),
            SchedOp::Drafts {
                n,
                by_slots,
                bad_counts,
                seed,
            } => {
                if self.pending.is_empty() {
                    self.drafts(n, by_slots, bad_counts, seed);
                }
            }
            SchedOp::Finish { id, reason } => {
                let id = request_id(id);
                let live = self.sched.slot_of(&id).is_some();
                let reason = match reason % 4 {
                    0 | 1 => FinishReason::Abort,
                    2 => FinishReason::Stop,
                    _ => FinishReason::Length,
                };
                let done = self
                    .sched
                    .finish_requests([id.as_str()], reason)
                    .unwrap_or_else(|e| panic!("finish_requests({id:?}) failed: {e}"));
                assert_eq!(done.len(), usize::from(live), "finish_requests result");
                assert!(
                    self.sched.slot_of(&id).is_none(),
                    "finished request still live"
                );
                self.starved.remove(&id);
            }
            SchedOp::Reset => {
                let held =
                    self.sched.kv().num_free_blocks() != self.sched.kv().pool().num_usable_blocks();
                let ok = self.sched.reset_prefix_cache();
                assert_eq!(
                    ok, !held,
                    "reset_prefix_cache returned {ok}, blocks held {held}"
                );
                if ok {
                    assert_eq!(self.sched.kv().pool().num_cached_blocks(), 0);
                    self.content.iter_mut().for_each(|c| *c = None);
                }
            }
        }
    }

    /// One `schedule()`; checks the output; returns whether it scheduled anything.
    fn schedule(&mut self, ctx: &str) -> bool {
        if let Err(e) = self.sched.schedule(&mut self.out) {
            panic!("{ctx}: schedule() failed: {e}");
        }
        self.check_step(ctx);
        self.forget_fresh_blocks();
        if self.out.num_reqs() == 0 {
            // An empty step awaits no output; handing back an empty one must be accepted.
            let step_id = self.out.step_id;
            if let Err(e) = self
                .sched
                .update_from_output(step_id, &[], &[], &mut self.upd)
            {
                panic!("{ctx}: empty output of empty step {step_id} refused: {e}");
            }
            return false;
        }
        self.stats.steps += 1;
        self.pending.push_back(self.out.clone());
        self.last = Some(self.out.clone());
        true
    }

    /// Blocks a step handed out fresh from the pool (all new blocks of running entries; for new
    /// and resumed entries, those after the prefix hits) no longer hold their old KV.
    fn forget_fresh_blocks(&mut self) {
        let out = &self.out;
        let bs = self.config.block_size;
        let mut start = 0;
        for i in 0..out.num_reqs() {
            let n = out.num_new_blocks[i] as usize;
            let blocks = &out.new_block_ids[start..start + n];
            start += n;
            let hits = match out.kinds[i] {
                EntryKind::Running => 0,
                EntryKind::New | EntryKind::Resumed => out.num_computed_tokens[i] as usize / bs,
            };
            for &b in &blocks[hits.min(n)..] {
                self.content[b as usize] = None;
            }
        }
    }

    /// The ownership contract and the shape of the step output, from the output alone.
    fn check_step(&self, ctx: &str) {
        let out = &self.out;
        let cfg = &self.config;
        let n = out.num_reqs();
        assert!(n <= cfg.max_num_seqs, "{ctx}: {n} requests > max_num_seqs");
        assert!(
            out.total_num_scheduled_tokens <= cfg.max_num_batched_tokens,
            "{ctx}: {} tokens scheduled > budget {}",
            out.total_num_scheduled_tokens,
            cfg.max_num_batched_tokens
        );
        for v in [
            out.kinds.len(),
            out.num_scheduled_tokens.len(),
            out.num_computed_tokens.len(),
            out.is_prefill_chunk.len(),
            out.num_new_blocks.len(),
            out.generations.len(),
            out.num_spec_tokens.len(),
        ] {
            assert_eq!(v, n, "{ctx}: output vectors of different lengths");
        }
        assert_eq!(
            out.query_start_loc.len(),
            n + 1,
            "{ctx}: query_start_loc length"
        );
        let new_blocks: u32 = out.num_new_blocks.iter().sum();
        assert_eq!(
            new_blocks as usize,
            out.new_block_ids.len(),
            "{ctx}: new blocks"
        );
        let spec: u32 = out.num_spec_tokens.iter().sum();
        assert_eq!(
            spec as usize,
            out.spec_token_ids.len(),
            "{ctx}: spec tokens"
        );
        let mut total = 0usize;
        let table = self.sched.block_table();
        let bs = cfg.block_size;
        for i in 0..n {
            let scheduled = out.num_scheduled_tokens[i];
            assert!(
                scheduled > 0,
                "{ctx}: entry {i} scheduled {scheduled} tokens"
            );
            total += scheduled as usize;
            assert_eq!(
                out.query_start_loc[i + 1] as usize,
                total,
                "{ctx}: query_start_loc"
            );
            let r =
                self.sched.requests().get(out.slots[i]).unwrap_or_else(|e| {
                    panic!("{ctx}: scheduled slot {} is gone: {e}", out.slots[i])
                });
            // A decode step verifies its drafts after the last sampled token. (A request the
            // harness starved with an empty sample has no new token: it may get drafts only.)
            assert!(
                (out.num_spec_tokens[i] as i32) < scheduled
                    || self.starved.contains(&r.spec.request_id),
                "{ctx}: entry {i} has {} drafts in {scheduled} tokens",
                out.num_spec_tokens[i]
            );
            let end = (out.num_computed_tokens[i] as usize + scheduled as usize + self.required)
                .min(cfg.max_model_len);
            let count = table.counts()[i] as usize;
            assert_eq!(count, r.blocks.block_ids.len(), "{ctx}: row {i} count");
            if end > 0 {
                let last_col = (end - 1) / bs;
                assert!(
                    last_col < count,
                    "{ctx}: ownership: request {} writes position {} but owns only {count} \
                     blocks ({} computed + {scheduled} scheduled + {} lookahead)",
                    r.spec.request_id,
                    end - 1,
                    out.num_computed_tokens[i],
                    self.required
                );
            }
            for (col, &b) in table.full_row(i)[..count].iter().enumerate() {
                assert!(
                    b > 0 && r.blocks.block_ids[col] == b as u32,
                    "{ctx}: row {i} column {col} maps to block {b}, not request {}'s block",
                    r.spec.request_id
                );
            }
        }
        assert_eq!(total, out.total_num_scheduled_tokens, "{ctx}: total tokens");
    }

    /// Tokens and counts of a well-formed output for `out`. `accept[i]`: 255 = an empty sample
    /// (starves a decode request; legal only without drafts), else `1 + accept % (drafts + 1)`
    /// tokens.
    fn valid_output(&self, out: &StepOutput, accept: &[u8], seed: u8) -> Output {
        let mut rng = Lcg::new(u32::from(seed) | (out.step_id as u32) << 8);
        let (mut tokens, mut counts, mut starved) = (Vec::new(), Vec::new(), Vec::new());
        for i in 0..out.num_reqs() {
            let a = accept.get(i).copied().unwrap_or(254);
            let drafts = out.num_spec_tokens[i];
            let count = if out.is_prefill_chunk[i] {
                u32::from(a % 2) // a discarded sample, or none
            } else if a == u8::MAX && drafts == 0 {
                let gen = out.generations[i];
                if let Some(r) = self
                    .sched
                    .requests()
                    .get(out.slots[i])
                    .ok()
                    .filter(|_| self.sched.requests().generation(out.slots[i]) == gen)
                {
                    starved.push(r.spec.request_id.clone());
                }
                0
            } else {
                1 + u32::from(a) % (drafts + 1)
            };
            counts.push(count);
            for _ in 0..count {
                // Mostly ordinary tokens; now and then EOS or the stop token.
                let t = match rng.next() % 64 {
                    0 => EOS,
                    1 => STOP,
                    x => 10 + x % 5,
                };
                tokens.push(t);
            }
        }
        Output {
            tokens,
            counts,
            starved,
        }
    }

    fn update(&mut self, mode: UpdateMode, accept: &[u8], seed: u8) {
        let front = self.pending.front().cloned();
        match (mode, front) {
            (UpdateMode::Valid, Some(out)) => {
                let o = self.valid_output(&out, accept, seed);
                if let Err(e) =
                    self.sched
                        .update_from_output(out.step_id, &o.tokens, &o.counts, &mut self.upd)
                {
                    panic!(
                        "well-formed update_from_output for step {} failed: {e}",
                        out.step_id
                    );
                }
                self.pending.pop_front();
                self.starved.extend(o.starved);
                self.after_update();
            }
            (UpdateMode::Valid, None) => {}
            (UpdateMode::Lost, front) => self.lose(front.as_ref(), accept, seed),
            (mode, front) => {
                let (step_id, mut tokens, mut counts) = match &front {
                    Some(out) => {
                        let o = self.valid_output(out, accept, seed);
                        (out.step_id, o.tokens, o.counts)
                    }
                    None => (self.out.step_id, vec![10], vec![1]),
                };
                let step_id = match mode {
                    UpdateMode::Stale => step_id.wrapping_sub(1),
                    UpdateMode::Future => step_id + 1 + u64::from(seed % 3),
                    UpdateMode::CountMismatch => {
                        counts.push(0);
                        step_id
                    }
                    UpdateMode::SumMismatch => {
                        tokens.push(10);
                        step_id
                    }
                    UpdateMode::OverCount => {
                        let i = usize::from(seed) % counts.len();
                        let extra =
                            front.as_ref().map_or(1, |o| o.num_spec_tokens[i] + 2) - counts[i];
                        counts[i] += extra;
                        tokens.extend((0..extra).map(|_| 10));
                        step_id
                    }
                    UpdateMode::EmptyDraftedDecode => {
                        let Some(out) = &front else { return };
                        let Some(i) = (0..out.num_reqs())
                            .find(|&i| out.num_spec_tokens[i] > 0 && !out.is_prefill_chunk[i])
                        else {
                            return;
                        };
                        let start: u32 = counts[..i].iter().sum();
                        tokens.drain(start as usize..(start + counts[i]) as usize);
                        counts[i] = 0;
                        step_id
                    }
                    UpdateMode::Valid | UpdateMode::Lost => unreachable!(),
                };
                if front.is_none() && counts.is_empty() {
                    return;
                }
                let before = self.snapshot();
                let res = self
                    .sched
                    .update_from_output(step_id, &tokens, &counts, &mut self.upd);
                match res {
                    Err(_) => {
                        assert_eq!(
                            before,
                            self.snapshot(),
                            "failed update_from_output changed state"
                        );
                        self.stats.refused_calls += 1;
                    }
                    Ok(()) => panic!(
                        "update_from_output({mode:?}, step {step_id}, counts {counts:?}) was \
                         accepted; pending step {:?}",
                        front.map(|o| o.step_id)
                    ),
                }
            }
        }
    }

    /// The output of the step in flight is lost: the step is abandoned (its requests roll
    /// back and must be scheduled again), after which its output is refused. With no step in
    /// flight, abandoning the last step is refused (applied or empty) or a no-op (abandoned).
    fn lose(&mut self, front: Option<&StepOutput>, accept: &[u8], seed: u8) {
        let Some(out) = front else {
            let before = self.snapshot();
            match self.sched.abandon_step(self.out.step_id) {
                Ok(0) | Err(CoreError::State(_)) => {}
                other => panic!("abandon_step of step {} gave {other:?}", self.out.step_id),
            }
            assert_eq!(
                before,
                self.snapshot(),
                "a refused abandon_step changed state"
            );
            return;
        };
        match self.sched.abandon_step(out.step_id) {
            Ok(1) => {}
            other => panic!("abandon_step of the step in flight gave {other:?}"),
        }
        self.pending.pop_front();
        self.check(&format!("abandon_step({})", out.step_id));
        let o = self.valid_output(out, accept, seed);
        let before = self.snapshot();
        match self
            .sched
            .update_from_output(out.step_id, &o.tokens, &o.counts, &mut self.upd)
        {
            Err(CoreError::State(_)) => self.stats.refused_calls += 1,
            other => panic!(
                "the output of abandoned step {} gave {other:?}",
                out.step_id
            ),
        }
        assert_eq!(before, self.snapshot(), "a refused output changed state");
        assert_eq!(
            self.sched.abandon_step(out.step_id),
            Ok(0),
            "abandoned twice"
        );
        self.stats.abandoned += 1;
    }

    fn after_update(&mut self) {
        for u in &self.upd.updates {
            assert!(u.tokens_start <= u.tokens_end, "update token range");
            assert!(
                u.tokens_end as usize <= self.upd.new_token_ids.len(),
                "update token range"
            );
        }
    }

    fn drafts(&mut self, n: u8, by_slots: bool, bad_counts: bool, seed: u8) {
        let k = self.config.num_speculative_tokens;
        let mut rng = Lcg::new(u32::from(seed));
        let len = || {
            let x = usize::from(n);
            if x % 8 == 7 {
                k + 1 + x / 8 % 4 // more drafts than K: refused
            } else {
                x % (k + 1)
            }
        };
        if by_slots {
            let Some(last) = self.last.clone() else {
                return;
            };
            let slots: Vec<(u32, u32)> = last
                .slots
                .iter()
                .copied()
                .zip(last.generations.iter().copied())
                .collect();
            let mut counts: Vec<u32> = slots.iter().map(|_| len() as u32).collect();
            let total: u32 = counts.iter().sum();
            let tokens: Vec<u32> = (0..total).map(|_| 10 + rng.next() % 5).collect();
            if bad_counts {
                counts.push(1);
                let before = self.snapshot();
                let res = self
                    .sched
                    .update_draft_token_ids_for_slots(&slots, &tokens, &counts);
                assert!(res.is_err(), "mismatched draft counts accepted");
                assert_eq!(before, self.snapshot(), "failed draft update changed state");
                self.stats.refused_calls += 1;
                return;
            }
            let before = counts
                .iter()
                .any(|&c| c as usize > k)
                .then(|| self.snapshot());
            let res = self
                .sched
                .update_draft_token_ids_for_slots(&slots, &tokens, &counts);
            self.expect_drafts_result(res, before, "by slot");
        } else {
            let ids: Vec<String> = self
                .sched
                .running()
                .iter()
                .filter_map(|&s| self.sched.requests().get(s).ok())
                .map(|r| r.spec.request_id.clone())
                .chain(bad_counts.then(|| "no-such-request".to_owned()))
                .collect();
            let drafts: Vec<(String, Vec<u32>)> = ids
                .into_iter()
                .map(|id| {
                    let d = (0..len()).map(|_| 10 + rng.next() % 5).collect();
                    (id, d)
                })
                .collect();
            let before = drafts
                .iter()
                .any(|(_, d)| d.len() > k)
                .then(|| self.snapshot());
            let res = self
                .sched
                .update_draft_token_ids(drafts.iter().map(|(id, d)| (id.as_str(), d.as_slice())));
            self.expect_drafts_result(res, before, "by id");
        }
    }

    /// A draft update is refused, changing nothing, exactly when it gave more than K drafts
    /// (`before` holds the state then).
    fn expect_drafts_result<T>(&mut self, res: CoreResult<T>, before: Option<String>, how: &str) {
        match res {
            Err(_) if before.is_some() => {
                assert_eq!(
                    before,
                    Some(self.snapshot()),
                    "refused drafts changed state"
                );
                self.stats.refused_calls += 1;
            }
            Err(e) => panic!("well-formed draft update {how} failed: {e}"),
            Ok(_) => assert!(before.is_none(), "more than K drafts {how} accepted"),
        }
    }

    /// Every invariant, after every operation.
    fn check(&mut self, ctx: &str) {
        if let Err(e) = self.sched.check_invariants() {
            panic!("after {ctx}: {e}");
        }
        // Tenant and prefix isolation: every cached block a request holds carries the KV of
        // exactly that request's prefix (tokens, LoRA, salt). A block records the prefix of the
        // first request seen holding it cached; a block handed out fresh forgets it.
        if self.exact_hits {
            let bs = self.config.block_size;
            let pool = self.sched.kv().pool();
            for (_, r) in self.sched.requests().iter() {
                let truth = truth_of(&r.tokens, &r.spec.extra, bs);
                let cached = &r.blocks.block_ids[..r.blocks.num_cached_blocks];
                for (j, &b) in cached.iter().enumerate() {
                    if pool.block_hash(b).is_none() {
                        continue;
                    }
                    let want = truth.get(j).copied();
                    match self.content[b as usize] {
                        None => self.content[b as usize] = want,
                        Some(have) => assert_eq!(
                            Some(have),
                            want,
                            "after {ctx}: request {}'s cached block {b} at index {j} holds the \
                             KV of another prefix or tenant",
                            r.spec.request_id
                        ),
                    }
                }
            }
        }
        let mml = self.config.max_model_len;
        for (_, r) in self.sched.requests().iter() {
            assert!(
                r.num_tokens() <= mml,
                "after {ctx}: request {} has {} tokens > max_model_len {mml}",
                r.spec.request_id,
                r.num_tokens()
            );
            assert!(
                !r.is_finished(),
                "after {ctx}: a finished request is still live"
            );
        }
    }

    /// A step scheduled, preempted and finished nothing while requests remain: the scheduler's
    /// state did not change, so no later step can make progress either.
    fn stuck(&mut self) {
        let head = self
            .sched
            .waiting_in_order()
            .first()
            .and_then(|&s| self.sched.requests().get(s).ok())
            .map(|r| (r.spec.request_id.clone(), r.num_tokens(), r.status));
        let msg = format!(
            "liveness: a step scheduled nothing and changed nothing, with {} requests unfinished \
             ({} waiting, {} running, {} of {} blocks free): they can never finish. Waiting \
             head (id, tokens, status): {head:?}",
            self.sched.num_unfinished(),
            self.sched.num_waiting(),
            self.sched.running().len(),
            self.sched.kv().num_free_blocks(),
            self.sched.kv().pool().num_usable_blocks(),
        );
        // Known findings (see docs/FUZZING.md): nothing runs, the whole pool is free, and the
        // head of the waiting queue still cannot be admitted, so it blocks the queue forever:
        // - `stuck-no-chunking`: chunked prefill is off and the prompt is over the token budget;
        // - `stuck-pool`: the request's tokens, or its tokens plus the method's lookahead, need
        //   more blocks than the whole pool.
        // They are tolerated (the head is aborted) only when allowed, to fuzz past them.
        let cfg = &self.config;
        let idle = self.sched.running().is_empty()
            && self.sched.kv().num_free_blocks() == self.sched.kv().pool().num_usable_blocks();
        let kind = head.as_ref().and_then(|&(_, tokens, _)| {
            let first = match cfg.long_prefill_token_threshold {
                0 => tokens,
                t => tokens.min(t),
            };
            let usable = self.sched.kv().pool().num_usable_blocks();
            let mml = cfg.max_model_len;
            let blocks = |n: usize| n.min(mml).div_ceil(cfg.block_size);
            let lookahead = cfg.required_lookahead();
            if !idle {
                None
            } else if !cfg.enable_chunked_prefill && first > cfg.max_num_batched_tokens {
                Some("stuck-no-chunking")
            } else if blocks(tokens + lookahead) > usable || blocks(tokens) > usable {
                Some("stuck-pool")
            } else {
                None
            }
        });
        match (head, kind) {
            (Some((id, _, _)), Some(kind)) if self.allow.has(kind) => {
                self.stats.tolerated += 1;
                if let Err(e) = self
                    .sched
                    .finish_requests([id.as_str()], FinishReason::Abort)
                {
                    panic!("abort of a stuck request failed: {e}");
                }
            }
            (_, kind) => panic!("{msg} [{}]", kind.unwrap_or("new kind")),
        }
    }

    /// Ends starved requests, then runs the engine loop with well-formed outputs (all drafts
    /// proposed, random acceptance) until every request has finished.
    fn drain(&mut self) {
        let starved: Vec<String> = self.starved.drain().collect();
        if let Err(e) = self
            .sched
            .finish_requests(starved.iter().map(String::as_str), FinishReason::Abort)
        {
            panic!("drain: abort failed: {e}");
        }
        while let Some(out) = self.pending.pop_front() {
            let o = self.valid_output(&out, &[], 7);
            if let Err(e) =
                self.sched
                    .update_from_output(out.step_id, &o.tokens, &o.counts, &mut self.upd)
            {
                panic!("drain: update_from_output failed: {e}");
            }
        }
        self.check("drain start");
        let mml = self.config.max_model_len;
        // Every request can finish in about (prompt + max_tokens) steps once it runs first;
        // allow for recomputation after preemptions.
        let limit = 64 + 8 * self.sched.num_unfinished() * (mml + 48);
        let k = self.config.num_speculative_tokens;
        let mut steps = 0;
        while self.sched.num_unfinished() > 0 {
            steps += 1;
            assert!(
                steps <= limit,
                "liveness: {} requests unfinished after {limit} drain steps",
                self.sched.num_unfinished()
            );
            let (pre, fin) = (
                self.sched.stats().num_preemptions,
                self.sched.stats().num_finished,
            );
            let scheduled = self.schedule("drain");
            self.check("drain schedule");
            if !scheduled {
                let stuck = self.sched.stats().num_preemptions == pre
                    && self.sched.stats().num_finished == fin;
                if stuck {
                    self.stuck();
                }
                continue;
            }
            let out = self.pending.pop_front().expect("a step was scheduled");
            let accept: Vec<u8> = (0..out.num_reqs())
                .map(|i| (steps + i) as u8 % 16)
                .collect();
            let o = self.valid_output(&out, &accept, steps as u8);
            if let Err(e) =
                self.sched
                    .update_from_output(out.step_id, &o.tokens, &o.counts, &mut self.upd)
            {
                panic!("drain: update_from_output failed: {e}");
            }
            self.check("drain update");
            let drafts: Vec<(String, Vec<u32>)> = self
                .upd
                .updates
                .iter()
                .filter(|u| u.finish_reason.is_none())
                .filter_map(|u| self.sched.requests().get(u.slot).ok())
                .map(|r| (r.spec.request_id.clone(), vec![10; k]))
                .collect();
            self.sched
                .update_draft_token_ids(drafts.iter().map(|(id, d)| (id.as_str(), d.as_slice())))
                .expect("K drafts per request are accepted");
        }
        self.stats.drain_steps = steps as u32;
        self.check("drain end");
        assert_eq!(
            self.sched.kv().num_free_blocks(),
            self.sched.kv().pool().num_usable_blocks(),
            "blocks still held after every request finished"
        );
    }
}
