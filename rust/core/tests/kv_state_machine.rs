//! State-machine property tests of the KV-cache manager against a reference model.
//!
//! Random operation sequences (add a request, look up its prefix and allocate slots, append decoded
//! tokens, preempt, finish, reset the prefix cache) run on the real [`KvCacheManager`] and on a
//! small model of vLLM V1's rules for one full-attention group, written from the spec (§1, §2) and
//! not from the Rust code. After every operation the two must agree block for block, and the
//! spec's invariants 1-16 (§7) that apply to one group are checked directly:
//!
//! | invariant | checked in |
//! |---|---|
//! | 1 null block, free + used == usable; 2 free queue <=> ref 0; 5 hash <=> registered | `check_all` |
//! | 3 touch / tail-first free order; 16 every block released once, unknown free is a no-op | model + `Harness::free` |
//! | 4 new blocks = free-queue head, ref 1, no hash; 12 block count; 14 append-only; 15 cached count | `check_allocation` |
//! | 6 duplicates keep their entries; 13 free hits cost capacity | model (first-inserted lookups, `blocks_to_allocate`) |
//! | 7 only full blocks of known tokens hashed | `check_request_hashes` |
//! | 8 hash chain | `block_hash_chain_depends_on_every_earlier_token` |
//! | 9 reset refused while held | `Harness::reset_prefix_cache` |
//! | 10 hit cap and alignment (no EAGLE drop: DFlash @0.33 keeps the last block) | `Harness::schedule` |
//! | 11 None <=> capacity check fails, and then nothing changed | model outcome + `Snapshot` |
//!
//! The model is content addressed: it keys a cached block by (LoRA, salt, every token up to the end
//! of the block), never by a hash, so it also catches a hasher that merges different prefixes or
//! splits equal ones.
//!
//! Failing seeds are saved to `rust/core/proptest-regressions/kv_state_machine.txt` and replayed
//! first on every run; commit that file with the fix. `PROPTEST_CASES=N` overrides the case count.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};

use dflash_core::free_queue::FreeQueue;
use dflash_core::kv_manager::{AllocateArgs, PrefixCacheStats, RequestBlocks, SequenceView};
use dflash_core::{
    BlockHash, BlockHasher, CoreError, ExtraKeys, HashAlgo, KvCacheManager, NULL_BLOCK,
};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{FileFailurePersistence, TestCaseError, TestRunner};

/// Cases of the state-machine test: about 5-15 s in release on one (shared) core. Debug builds
/// (which also turn on the core's debug assertions) run fewer, in about the same time.
const STATE_MACHINE_CASES: u32 = if cfg!(debug_assertions) {
    2_000
} else {
    40_000
};
const REGRESSIONS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/proptest-regressions/kv_state_machine.txt"
);
const BLOCK_SIZES: [usize; 4] = [1, 2, 4, 16];
const ALGOS: [HashAlgo; 3] = [HashAlgo::Sha256, HashAlgo::Blake3, HashAlgo::Xxh3_128];
/// Tokens come from a 7-letter alphabet so that unrelated prompts share blocks too.
const ALPHABET: u32 = 7;

fn proptest_config(default_cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(REGRESSIONS))),
        source_file: Some(file!()),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Generated input
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Config {
    /// Including the null block.
    num_blocks: usize,
    block_size: usize,
    max_model_len: usize,
    caching: bool,
    algo: HashAlgo,
}

/// Token counts are generated in quarter blocks so that every block size sees multi-block prompts.
#[derive(Debug, Clone)]
enum Op {
    /// A new request: a prefix of shared template `template`, then pseudo-random suffix tokens.
    Add {
        template: u8,
        prefix_quarters: u8,
        suffix_quarters: u8,
        suffix_seed: u32,
        lora: Option<u8>,
        salt: Option<u8>,
    },
    /// One scheduler step for a request: prefix lookup if it holds no blocks, then allocate_slots.
    Schedule(Step),
    /// Accepted tokens of a decode step.
    Append {
        req: Index,
        quarters: u8,
        seed: u32,
    },
    /// Free the request's blocks but keep it (it restarts from token 0).
    Preempt {
        req: Index,
    },
    /// Free the request's blocks and drop it.
    Finish {
        req: Index,
    },
    /// The scheduler undoing a priority victim's step: withdraw the cache entries that step
    /// registered (`uncache_blocks`), then preempt.
    UndoAndPreempt {
        req: Index,
    },
    ResetPrefixCache,
    /// An invalid allocate_slots call: it must fail and change nothing.
    Misuse {
        req: Index,
        kind: Misuse,
    },
}

#[derive(Debug, Clone, Copy)]
enum Misuse {
    NoNewTokens,
    HitLengthMismatch,
    ComputedPastOwnedSlots,
    BlockIdOutOfRange,
    MissingBlockHashes,
}

#[derive(Debug, Clone)]
struct Step {
    req: Index,
    /// 0: every remaining known token; else at most `chunk_halves` half blocks (chunked prefill).
    chunk_halves: u8,
    /// Unverified draft tokens scheduled after the known ones (never cached).
    num_drafts: u8,
    num_lookahead_tokens: u8,
    full_sequence_must_fit: bool,
    /// False models `skip_reading_prefix_cache`: the request recomputes and so duplicates blocks.
    read_prefix_cache: bool,
    /// Schedule past max_model_len on purpose (the manager must refuse with TooLong).
    past_max_model_len: bool,
}

fn config_strategy() -> impl Strategy<Value = Config> {
    (
        2usize..=32,
        prop::sample::select(BLOCK_SIZES.to_vec()),
        1usize..=48,
        0usize..16,
        prop::bool::weighted(0.8),
        prop::sample::select(ALGOS.to_vec()),
    )
        .prop_map(
            |(num_blocks, block_size, mml_blocks, mml_extra, caching, algo)| Config {
                num_blocks,
                block_size,
                max_model_len: mml_blocks * block_size + mml_extra % block_size,
                caching,
                algo,
            },
        )
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let add = (
        0u8..3,
        0u8..=24,
        0u8..=12,
        any::<u32>(),
        prop::option::weighted(0.25, 0u8..2),
        prop::option::weighted(0.25, 0u8..2),
    )
        .prop_map(
            |(template, prefix_quarters, suffix_quarters, suffix_seed, lora, salt)| Op::Add {
                template,
                prefix_quarters,
                suffix_quarters,
                suffix_seed,
                lora,
                salt,
            },
        );
    let step = (
        any::<Index>(),
        prop_oneof![3 => Just(0u8), 1 => 1u8..=8],
        prop_oneof![2 => Just(0u8), 1 => 1u8..=8],
        0u8..=20,
        any::<bool>(),
        prop::bool::weighted(0.85),
        prop::bool::weighted(0.05),
    )
        .prop_map(
            |(req, chunk_halves, num_drafts, lookahead, must_fit, read, past)| {
                Op::Schedule(Step {
                    req,
                    chunk_halves,
                    num_drafts,
                    num_lookahead_tokens: lookahead,
                    full_sequence_must_fit: must_fit,
                    read_prefix_cache: read,
                    past_max_model_len: past,
                })
            },
        );
    let append =
        (any::<Index>(), 1u8..=8, any::<u32>()).prop_map(|(req, quarters, seed)| Op::Append {
            req,
            quarters,
            seed,
        });
    prop_oneof![
        3 => add,
        8 => step,
        3 => append,
        1 => any::<Index>().prop_map(|req| Op::Preempt { req }),
        3 => any::<Index>().prop_map(|req| Op::Finish { req }),
        1 => any::<Index>().prop_map(|req| Op::UndoAndPreempt { req }),
        1 => Just(Op::ResetPrefixCache),
        1 => (any::<Index>(), prop::sample::select(vec![
            Misuse::NoNewTokens,
            Misuse::HitLengthMismatch,
            Misuse::ComputedPastOwnedSlots,
            Misuse::BlockIdOutOfRange,
            Misuse::MissingBlockHashes,
        ]))
            .prop_map(|(req, kind)| Op::Misuse { req, kind }),
    ]
}

fn quarters_to_tokens(quarters: u8, block_size: usize) -> usize {
    quarters as usize * block_size / 4
}

/// Deterministic tokens from a seed (a tiny LCG: shrinking the seed keeps the case valid).
fn seeded_tokens(seed: u32, count: usize) -> impl Iterator<Item = u32> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        (state >> 16) % ALPHABET
    })
    .take(count)
}

fn template_token(template: u8, position: usize) -> u32 {
    let t = template as usize;
    ((position * (t + 2) + t) % ALPHABET as usize) as u32
}

// ---------------------------------------------------------------------------------------------
// Requests as the test driver (the "scheduler") keeps them
// ---------------------------------------------------------------------------------------------

/// What identifies a block's content: the model's prefix-cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct ContentKey {
    lora: Option<u8>,
    salt: Option<u8>,
    tokens: Vec<u32>,
}

#[derive(Debug)]
struct Content {
    lora: Option<u8>,
    salt: Option<u8>,
    /// `lora` and `salt` as the hasher sees them.
    extra: ExtraKeys,
    tokens: Vec<u32>,
    /// Real chained hashes of the full blocks (empty with caching off, as the bindings do).
    hashes: Vec<BlockHash>,
}

impl Content {
    fn key(&self, block: usize, block_size: usize) -> ContentKey {
        ContentKey {
            lora: self.lora,
            salt: self.salt,
            tokens: self.tokens[..(block + 1) * block_size].to_vec(),
        }
    }

    fn extra_keys(&self) -> ExtraKeys {
        self.extra.clone()
    }

    fn view(&self) -> SequenceView<'_> {
        SequenceView {
            tokens: &self.tokens,
            block_hashes: &self.hashes,
            extra: &self.extra,
        }
    }
}

/// The model's per-request state.
#[derive(Debug, Default)]
struct ModelRequest {
    blocks: Vec<u32>,
    num_cached: usize,
}

#[derive(Debug)]
struct Request {
    content: Content,
    num_computed_tokens: usize,
    /// `num_cached_blocks` before the last successful allocation (what undoing it restores).
    cached_before_last_step: usize,
    real: RequestBlocks,
    model: ModelRequest,
}

// ---------------------------------------------------------------------------------------------
// The reference model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    TooLong,
    NoRoom,
    Allocated { first_new: usize },
}

/// vLLM V1's block pool + single full-attention manager, with plain containers.
struct Model {
    block_size: usize,
    max_model_len: usize,
    caching: bool,
    /// Eviction order: front is reused first.
    free: VecDeque<u32>,
    ref_cnt: Vec<u32>,
    /// Content (and the real hash, to compare with) of each block registered in the cache.
    registered: Vec<Option<(ContentKey, BlockHash)>>,
    /// Registered blocks per content, in insertion order.
    cache: HashMap<ContentKey, Vec<u32>>,
    stats: PrefixCacheStats,
}

impl Model {
    fn new(cfg: &Config) -> Self {
        Self {
            block_size: cfg.block_size,
            max_model_len: cfg.max_model_len,
            caching: cfg.caching,
            free: (1..cfg.num_blocks as u32).collect(),
            ref_cnt: vec![0; cfg.num_blocks],
            registered: vec![None; cfg.num_blocks],
            cache: HashMap::new(),
            stats: PrefixCacheStats::default(),
        }
    }

    /// §2.2: longest run of cached leading blocks, capped at `num_tokens - 1` tokens.
    fn lookup(&mut self, content: &Content) -> Vec<u32> {
        if !self.caching {
            return Vec::new();
        }
        let max_blocks = (content.tokens.len() - 1) / self.block_size;
        let mut hits = Vec::new();
        for i in 0..max_blocks {
            match self
                .cache
                .get(&content.key(i, self.block_size))
                .and_then(|blocks| blocks.first())
            {
                Some(&b) => hits.push(b),
                None => break,
            }
        }
        self.stats.requests += 1;
        self.stats.queries += content.tokens.len() as u64;
        self.stats.hits += (hits.len() * self.block_size) as u64;
        hits
    }

    /// §2.4: blocks the free queue gives up; adopting a free cached hit costs one.
    fn blocks_to_allocate(&self, held: &[u32], hits: &[u32], num_tokens: usize) -> usize {
        let required = num_tokens.div_ceil(self.block_size);
        if !held.is_empty() {
            return required.saturating_sub(held.len());
        }
        let free_hits = hits
            .iter()
            .filter(|&&b| self.ref_cnt[b as usize] == 0)
            .count();
        required.saturating_sub(hits.len()) + free_hits
    }

    /// §2.3: allocate_slots for one request.
    fn allocate(
        &mut self,
        content: &Content,
        req: &mut ModelRequest,
        num_computed_tokens: usize,
        hits: &[u32],
        step: &Step,
        num_new_tokens: usize,
    ) -> Outcome {
        let total = num_computed_tokens + hits.len() * self.block_size;
        let main = total + num_new_tokens;
        if main > self.max_model_len {
            return Outcome::TooLong;
        }
        let need_slot = (main + step.num_lookahead_tokens as usize).min(self.max_model_len);
        let num_tokens = content.tokens.len();
        if step.full_sequence_must_fit
            && self.blocks_to_allocate(&req.blocks, hits, num_tokens.min(self.max_model_len))
                > self.free.len()
        {
            return Outcome::NoRoom;
        }
        if self.blocks_to_allocate(&req.blocks, hits, need_slot) > self.free.len() {
            return Outcome::NoRoom;
        }
        for &b in hits {
            if self.ref_cnt[b as usize] == 0 {
                let at = self
                    .free
                    .iter()
                    .position(|&f| f == b)
                    .expect("free hit is in the free queue");
                self.free.remove(at);
            }
            self.ref_cnt[b as usize] += 1;
            req.blocks.push(b);
        }
        if !hits.is_empty() {
            req.num_cached = hits.len();
        }
        let first_new = req.blocks.len();
        while req.blocks.len() < need_slot.div_ceil(self.block_size) {
            let b = self.free.pop_front().expect("capacity was checked");
            self.unregister(b);
            self.ref_cnt[b as usize] = 1;
            req.blocks.push(b);
        }
        if self.caching {
            let num_full = main.min(num_tokens) / self.block_size;
            for i in req.num_cached..num_full {
                let b = req.blocks[i];
                let key = content.key(i, self.block_size);
                self.cache.entry(key.clone()).or_default().push(b);
                self.registered[b as usize] = Some((key, content.hashes[i]));
            }
            req.num_cached = req.num_cached.max(num_full);
        }
        Outcome::Allocated { first_new }
    }

    fn unregister(&mut self, block: u32) {
        if let Some((key, _)) = self.registered[block as usize].take() {
            let blocks = self
                .cache
                .get_mut(&key)
                .expect("registered key is in the cache");
            blocks.retain(|&b| b != block);
            if blocks.is_empty() {
                self.cache.remove(&key);
            }
        }
    }

    /// §2.7: tail block first; blocks reaching zero join the tail of the free queue.
    /// vLLM 0.33: released tail first; cached blocks to the tail of the queue, blocks without
    /// a hash to the head (in release order).
    fn free(&mut self, req: &mut ModelRequest) {
        let mut reuse_first = Vec::new();
        for &b in req.blocks.iter().rev() {
            self.ref_cnt[b as usize] -= 1;
            if self.ref_cnt[b as usize] == 0 {
                if self.registered[b as usize].is_some() {
                    self.free.push_back(b);
                } else {
                    reuse_first.push(b);
                }
            }
        }
        for &b in reuse_first.iter().rev() {
            self.free.push_front(b);
        }
        req.blocks.clear();
        req.num_cached = 0;
    }

    /// §1.8: only when nothing is held.
    fn reset_prefix_cache(&mut self) -> bool {
        if self.ref_cnt.iter().any(|&rc| rc > 0) {
            return false;
        }
        self.cache.clear();
        self.registered.iter_mut().for_each(|r| *r = None);
        true
    }

    fn num_registrations(&self) -> usize {
        self.cache.values().map(Vec::len).sum()
    }
}

// ---------------------------------------------------------------------------------------------
// Checks
// ---------------------------------------------------------------------------------------------

/// Everything observable about the real manager, to prove an operation changed nothing.
#[derive(Debug, PartialEq)]
struct Snapshot {
    free: Vec<u32>,
    ref_cnt: Vec<u32>,
    hashes: Vec<Option<BlockHash>>,
    requests: Vec<RequestBlocks>,
    stats: PrefixCacheStats,
}

impl Snapshot {
    fn take(mgr: &KvCacheManager, live: &[Request]) -> Self {
        let pool = mgr.pool();
        let ids = 0..pool.num_blocks() as u32;
        Self {
            free: pool.free_block_ids(),
            ref_cnt: ids.clone().map(|b| pool.ref_count(b)).collect(),
            hashes: ids.map(|b| pool.block_hash(b).copied()).collect(),
            requests: live.iter().map(|r| r.real.clone()).collect(),
            stats: mgr.prefix_cache_stats(),
        }
    }
}

fn fail(e: CoreError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Real manager == model, plus invariants 1, 2, 5, 7 (§7) checked directly.
fn check_all(mgr: &KvCacheManager, model: &Model, live: &[Request]) -> Result<(), TestCaseError> {
    mgr.check_invariants(live.iter().map(|r| &r.real))
        .map_err(fail)?;
    let pool = mgr.pool();
    let num_blocks = pool.num_blocks();
    let free = pool.free_block_ids();
    prop_assert_eq!(
        &free,
        &model.free.iter().copied().collect::<Vec<_>>(),
        "free queue order"
    );
    prop_assert_eq!(mgr.num_free_blocks(), free.len());
    prop_assert_eq!(mgr.prefix_cache_stats(), model.stats);

    let mut holders = vec![0u32; num_blocks];
    for r in live {
        prop_assert_eq!(&r.real.block_ids, &r.model.blocks, "block table");
        prop_assert_eq!(
            r.real.num_cached_blocks,
            r.model.num_cached,
            "num_cached_blocks"
        );
        for &b in &r.real.block_ids {
            prop_assert!(
                b != NULL_BLOCK && (b as usize) < num_blocks,
                "invalid block {}",
                b
            );
            holders[b as usize] += 1;
        }
        let mut distinct = r.real.block_ids.clone();
        distinct.sort_unstable();
        distinct.dedup();
        prop_assert_eq!(
            distinct.len(),
            r.real.block_ids.len(),
            "a request lists a block twice"
        );
        check_request_hashes(mgr, model, r)?;
    }

    // Invariant 1: the null block is never free, held or hashed; free + held == usable.
    prop_assert!(!free.contains(&NULL_BLOCK));
    prop_assert_eq!(pool.ref_count(NULL_BLOCK), 0);
    prop_assert!(pool.block_hash(NULL_BLOCK).is_none());
    let held = holders.iter().filter(|&&h| h > 0).count();
    prop_assert_eq!(free.len() + held, num_blocks - 1, "free + used == usable");
    let usage = 1.0 - free.len() as f64 / (num_blocks - 1) as f64;
    prop_assert!((mgr.usage() - usage).abs() < 1e-12);

    let mut in_free = vec![false; num_blocks];
    free.iter().for_each(|&b| in_free[b as usize] = true);
    for b in 1..num_blocks {
        let rc = pool.ref_count(b as u32);
        // Ref count == number of requests listing the block == model; invariant 2.
        prop_assert_eq!(rc, holders[b], "block {}: ref count vs holders", b);
        prop_assert_eq!(rc, model.ref_cnt[b], "block {}: ref count vs model", b);
        prop_assert_eq!(
            in_free[b],
            rc == 0,
            "block {}: in free queue <=> ref count 0",
            b
        );
        // Invariant 5: a block carries a hash <=> it is registered, under that hash.
        let expected = model.registered[b].as_ref().map(|(_, hash)| hash);
        prop_assert_eq!(pool.block_hash(b as u32), expected, "block {}: hash", b);
    }
    prop_assert_eq!(pool.num_cached_blocks(), model.num_registrations());
    for blocks in model.cache.values() {
        let (_, hash) = model.registered[blocks[0] as usize]
            .as_ref()
            .expect("listed blocks are registered");
        prop_assert_eq!(
            pool.get_cached_block(hash),
            Some(blocks[0]),
            "lookup returns the first registered"
        );
    }
    Ok(())
}

/// Invariant 7: only the leading `num_cached` blocks, all full blocks of known tokens, carry
/// hashes, and each carries its own position's hash.
fn check_request_hashes(
    mgr: &KvCacheManager,
    model: &Model,
    r: &Request,
) -> Result<(), TestCaseError> {
    let pool = mgr.pool();
    let num_tokens = r.content.tokens.len();
    prop_assert!(
        r.real.num_cached_blocks * model.block_size <= num_tokens,
        "cached past the known tokens"
    );
    prop_assert!(
        r.real.block_ids.len() * model.block_size >= r.num_computed_tokens,
        "computed tokens lack slots"
    );
    if !model.caching {
        prop_assert_eq!(r.real.num_cached_blocks, 0);
    }
    for (i, &b) in r.real.block_ids.iter().enumerate() {
        if i < r.real.num_cached_blocks {
            prop_assert_eq!(
                pool.block_hash(b),
                Some(&r.content.hashes[i]),
                "cached block {} hash",
                i
            );
        } else {
            prop_assert!(
                pool.block_hash(b).is_none(),
                "block {} past num_cached_blocks is hashed",
                i
            );
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Applying operations
// ---------------------------------------------------------------------------------------------

/// How often the interesting paths ran, so a generator change that starves one shows up.
#[derive(Debug, Default)]
struct Coverage {
    hits: Cell<u64>,
    hits_on_free_blocks: Cell<u64>,
    allocated: Cell<u64>,
    no_room: Cell<u64>,
    too_long: Cell<u64>,
    evictions: Cell<u64>,
    duplicate_keys: Cell<u64>,
    resets: Cell<u64>,
    refused_resets: Cell<u64>,
    refused_misuse: Cell<u64>,
    withdrawn_entries: Cell<u64>,
}

fn bump(counter: &Cell<u64>) {
    counter.set(counter.get() + 1);
}

struct Harness<'a> {
    cfg: Config,
    mgr: KvCacheManager,
    model: Model,
    hasher: BlockHasher,
    live: Vec<Request>,
    coverage: &'a Coverage,
}

impl<'a> Harness<'a> {
    fn new(cfg: Config, coverage: &'a Coverage) -> Self {
        let mgr = KvCacheManager::new(
            cfg.num_blocks,
            cfg.block_size,
            cfg.max_model_len,
            cfg.caching,
        )
        .expect("valid config");
        Self {
            model: Model::new(&cfg),
            hasher: BlockHasher::new(cfg.algo, cfg.block_size, b"kv_state_machine"),
            mgr,
            live: Vec::new(),
            coverage,
            cfg,
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Add {
                template,
                prefix_quarters,
                suffix_quarters,
                suffix_seed,
                lora,
                salt,
            } => {
                let bs = self.cfg.block_size;
                let prefix_len = quarters_to_tokens(*prefix_quarters, bs);
                let mut tokens: Vec<u32> = (0..prefix_len)
                    .map(|p| template_token(*template, p))
                    .collect();
                tokens.extend(seeded_tokens(
                    *suffix_seed,
                    quarters_to_tokens(*suffix_quarters, bs),
                ));
                tokens.truncate(self.cfg.max_model_len);
                if tokens.is_empty() {
                    tokens.push(0);
                }
                let mut content = Content {
                    lora: *lora,
                    salt: *salt,
                    extra: extra_of(*lora, *salt),
                    tokens,
                    hashes: Vec::new(),
                };
                self.rehash(&mut content);
                self.live.push(Request {
                    content,
                    num_computed_tokens: 0,
                    cached_before_last_step: 0,
                    real: RequestBlocks::default(),
                    model: ModelRequest::default(),
                });
            }
            Op::Schedule(step) => self.schedule(step)?,
            Op::Append {
                req,
                quarters,
                seed,
            } => {
                if self.live.is_empty() {
                    return Ok(());
                }
                let i = req.index(self.live.len());
                let room = self.cfg.max_model_len - self.live[i].content.tokens.len();
                let count = quarters_to_tokens(*quarters, self.cfg.block_size)
                    .max(1)
                    .min(room);
                let mut content = std::mem::replace(&mut self.live[i].content, empty_content());
                content.tokens.extend(seeded_tokens(*seed, count));
                self.rehash(&mut content);
                self.live[i].content = content;
            }
            Op::Preempt { req } => {
                if !self.live.is_empty() {
                    let i = req.index(self.live.len());
                    self.free(i)?;
                }
            }
            Op::Finish { req } => {
                if !self.live.is_empty() {
                    let i = req.index(self.live.len());
                    self.free(i)?;
                    self.live.remove(i);
                }
            }
            Op::UndoAndPreempt { req } => {
                if !self.live.is_empty() {
                    let i = req.index(self.live.len());
                    self.undo_last_step(i)?;
                    self.free(i)?;
                }
            }
            Op::ResetPrefixCache => self.reset_prefix_cache()?,
            Op::Misuse { req, kind } => {
                if !self.live.is_empty() {
                    let i = req.index(self.live.len());
                    self.misuse(i, *kind)?;
                }
            }
        }
        check_all(&self.mgr, &self.model, &self.live)
    }

    /// Appends hashes of newly full blocks, as the bindings do after every token append.
    fn rehash(&self, content: &mut Content) {
        if self.cfg.caching {
            let extra = content.extra_keys();
            self.hasher
                .extend_hashes(&mut content.hashes, &content.tokens, &extra);
        }
    }

    fn schedule(&mut self, step: &Step) -> Result<(), TestCaseError> {
        if self.live.is_empty() {
            return Ok(());
        }
        let i = step.req.index(self.live.len());
        let bs = self.cfg.block_size;
        let max_model_len = self.cfg.max_model_len;

        // A request holding no blocks (new or preempted) first looks up its prefix.
        let waiting = self.live[i].real.block_ids.is_empty();
        let mut hits = Vec::new();
        if waiting && step.read_prefix_cache {
            let r = &self.live[i];
            let hit_tokens = self.mgr.get_computed_blocks(r.content.view(), &mut hits);
            let model_hits = self.model.lookup(&r.content);
            prop_assert_eq!(&hits, &model_hits, "prefix-cache hits");
            // Invariant 10 (no EAGLE drop: DFlash @0.33 does not drop the last block).
            prop_assert_eq!(hit_tokens, hits.len() * bs);
            prop_assert!(
                hit_tokens < r.content.tokens.len(),
                "hit covers the last token"
            );
            if !hits.is_empty() {
                bump(&self.coverage.hits);
            }
            if hits.iter().any(|&b| self.mgr.pool().ref_count(b) == 0) {
                bump(&self.coverage.hits_on_free_blocks);
            }
        }

        let r = &self.live[i];
        let num_tokens = r.content.tokens.len();
        let start = r.num_computed_tokens + hits.len() * bs;
        let remaining = num_tokens.saturating_sub(start);
        let chunk = match step.chunk_halves {
            0 => remaining,
            halves => remaining.min((halves as usize * bs / 2).max(1)),
        };
        let mut num_new_tokens = (chunk + step.num_drafts as usize).max(1);
        if !step.past_max_model_len {
            num_new_tokens = num_new_tokens.min(max_model_len.saturating_sub(start));
        }
        if num_new_tokens == 0 {
            return Ok(()); // at max_model_len: nothing left to schedule
        }

        let before = Snapshot::take(&self.mgr, &self.live);
        let r = &mut self.live[i];
        let held_before = r.real.block_ids.clone();
        let expected = self.model.allocate(
            &r.content,
            &mut r.model,
            r.num_computed_tokens,
            &hits,
            step,
            num_new_tokens,
        );
        let args = AllocateArgs {
            num_new_tokens,
            num_computed_tokens: r.num_computed_tokens,
            num_new_computed_tokens: hits.len() * bs,
            new_computed_blocks: &hits,
            num_lookahead_tokens: step.num_lookahead_tokens as usize,
            full_sequence_must_fit: step.full_sequence_must_fit,
        };
        let got = self.mgr.allocate_slots(&mut r.real, r.content.view(), args);
        match (expected, got) {
            (Outcome::TooLong, Err(CoreError::TooLong(_))) => {
                bump(&self.coverage.too_long);
                prop_assert_eq!(
                    Snapshot::take(&self.mgr, &self.live),
                    before,
                    "a refused call changed state"
                );
            }
            (Outcome::NoRoom, Ok(None)) => {
                // Invariant 11: all or nothing.
                bump(&self.coverage.no_room);
                prop_assert_eq!(
                    Snapshot::take(&self.mgr, &self.live),
                    before,
                    "None changed state"
                );
            }
            (Outcome::Allocated { first_new }, Ok(Some(got_first_new))) => {
                bump(&self.coverage.allocated);
                prop_assert_eq!(got_first_new, first_new, "first new block index");
                self.check_allocation(
                    i,
                    step,
                    &hits,
                    &held_before,
                    &before,
                    num_new_tokens,
                    first_new,
                )?;
                let r = &mut self.live[i];
                r.cached_before_last_step = before.requests[i].num_cached_blocks;
                r.num_computed_tokens = (start + num_new_tokens).min(num_tokens);
            }
            (expected, got) => {
                return Err(TestCaseError::fail(format!(
                    "model expected {expected:?}, manager returned {got:?}"
                )))
            }
        }
        Ok(())
    }

    /// Invariants 4, 12, 14, 15 after a successful allocate_slots.
    #[allow(clippy::too_many_arguments)]
    fn check_allocation(
        &self,
        i: usize,
        step: &Step,
        hits: &[u32],
        held_before: &[u32],
        before: &Snapshot,
        num_new_tokens: usize,
        first_new: usize,
    ) -> Result<(), TestCaseError> {
        let bs = self.cfg.block_size;
        let pool = self.mgr.pool();
        let r = &self.live[i];
        let blocks = &r.real.block_ids;
        let total = r.num_computed_tokens + hits.len() * bs;
        let need_slot = (total + num_new_tokens + step.num_lookahead_tokens as usize)
            .min(self.cfg.max_model_len);

        // 12: exactly max(len_before, cdiv(need_slot, B)) blocks.
        prop_assert_eq!(blocks.len(), held_before.len().max(need_slot.div_ceil(bs)));
        // 14: the table only grows; hits come first, in order.
        prop_assert_eq!(&blocks[..held_before.len()], held_before);
        prop_assert_eq!(
            &blocks[held_before.len()..held_before.len() + hits.len()],
            hits
        );
        // 4: new blocks are the head of the free queue once the hits left it, with one reference.
        let new_blocks = &blocks[first_new..];
        let expected_new: Vec<u32> = before
            .free
            .iter()
            .copied()
            .filter(|b| !hits.contains(b))
            .take(new_blocks.len())
            .collect();
        prop_assert_eq!(
            new_blocks,
            &expected_new[..],
            "new blocks are the free-queue head"
        );
        for &b in new_blocks {
            prop_assert_eq!(pool.ref_count(b), 1);
        }
        if new_blocks
            .iter()
            .any(|&b| before.hashes[b as usize].is_some())
        {
            bump(&self.coverage.evictions);
        }
        // 15: num_cached_blocks == max(#hits, floor(min(total + new, num_tokens) / B)).
        let expected_cached = if self.cfg.caching {
            hits.len()
                .max((total + num_new_tokens).min(r.content.tokens.len()) / bs)
        } else {
            0
        };
        prop_assert_eq!(
            r.real.num_cached_blocks,
            expected_cached,
            "num_cached_blocks formula"
        );
        if self.model.cache.values().any(|blocks| blocks.len() > 1) {
            bump(&self.coverage.duplicate_keys);
        }
        Ok(())
    }

    /// Invariants 3 and 16: every block released exactly once, tail first; a second free is a no-op.
    fn free(&mut self, i: usize) -> Result<(), TestCaseError> {
        let pool = self.mgr.pool();
        let blocks = self.live[i].real.block_ids.clone();
        let refs_before: Vec<u32> = blocks.iter().map(|&b| pool.ref_count(b)).collect();
        let released: Vec<u32> = blocks
            .iter()
            .rev()
            .zip(refs_before.iter().rev())
            .filter(|(_, &rc)| rc == 1)
            .map(|(&b, _)| b)
            .collect();
        let (cached, uncached): (Vec<u32>, Vec<u32>) = released
            .iter()
            .partition(|&&b| pool.block_hash(b).is_some());
        let mut expected_free = uncached;
        expected_free.extend(pool.free_block_ids());
        expected_free.extend(cached);

        let r = &mut self.live[i];
        self.mgr.free(&mut r.real);
        self.model.free(&mut r.model);
        r.num_computed_tokens = 0;
        prop_assert!(r.real.block_ids.is_empty() && r.real.num_cached_blocks == 0);

        let pool = self.mgr.pool();
        for (&b, &rc) in blocks.iter().zip(&refs_before) {
            prop_assert_eq!(pool.ref_count(b), rc - 1, "block {} released once", b);
        }
        prop_assert_eq!(
            pool.free_block_ids(),
            expected_free,
            "freed blocks: uncached to the head, cached to the tail, tail first"
        );

        let before = Snapshot::take(&self.mgr, &self.live);
        self.mgr.free(&mut self.live[i].real);
        prop_assert_eq!(
            Snapshot::take(&self.mgr, &self.live),
            before,
            "a second free changed state"
        );
        Ok(())
    }

    /// Calls no correct caller makes must return an error and leave everything as it was.
    fn misuse(&mut self, i: usize, kind: Misuse) -> Result<(), TestCaseError> {
        let bs = self.cfg.block_size;
        let before = Snapshot::take(&self.mgr, &self.live);
        let out_of_range = [self.cfg.num_blocks as u32 + 3];
        let r = &mut self.live[i];
        let owned_slots = r.real.block_ids.len() * bs;
        let mut args = AllocateArgs {
            num_new_tokens: 1,
            num_computed_tokens: r.num_computed_tokens,
            ..AllocateArgs::default()
        };
        let mut view = r.content.view();
        match kind {
            Misuse::NoNewTokens => args.num_new_tokens = 0,
            Misuse::HitLengthMismatch => args.num_new_computed_tokens = bs,
            Misuse::ComputedPastOwnedSlots => args.num_computed_tokens = owned_slots + 1,
            Misuse::BlockIdOutOfRange => {
                args.num_computed_tokens = 0;
                args.num_new_computed_tokens = bs;
                args.new_computed_blocks = &out_of_range;
            }
            Misuse::MissingBlockHashes => {
                // Caching a full block needs its hash: only an error when one would be cached.
                let will_cache = self.cfg.caching
                    && (r.num_computed_tokens + bs).min(r.content.tokens.len()) / bs
                        > r.real.num_cached_blocks;
                if !will_cache || r.num_computed_tokens + bs > self.cfg.max_model_len {
                    return Ok(());
                }
                args.num_new_tokens = bs;
                view.block_hashes = &[];
            }
        }
        let got = self.mgr.allocate_slots(&mut r.real, view, args);
        prop_assert!(
            matches!(
                got,
                Err(CoreError::InvalidArgument(_) | CoreError::TooLong(_))
            ),
            "{:?} returned {:?}",
            kind,
            got
        );
        prop_assert_eq!(
            Snapshot::take(&self.mgr, &self.live),
            before,
            "a refused call changed state"
        );
        bump(&self.coverage.refused_misuse);
        Ok(())
    }

    /// `uncache_blocks(from)`: entries of blocks `from..num_cached` go unless another request
    /// holds the block. Checked once the request is freed (as the scheduler always does next).
    fn undo_last_step(&mut self, i: usize) -> Result<(), TestCaseError> {
        let r = &mut self.live[i];
        let from = r.cached_before_last_step;
        let end = r.model.num_cached.min(r.model.blocks.len());
        for &b in r.model.blocks.get(from..end).unwrap_or(&[]) {
            if self.model.ref_cnt[b as usize] == 1 && self.model.registered[b as usize].is_some() {
                self.model.unregister(b);
                bump(&self.coverage.withdrawn_entries);
            }
        }
        r.model.num_cached = r.model.num_cached.min(from);
        self.mgr.uncache_blocks(&mut r.real, from);
        prop_assert_eq!(r.real.num_cached_blocks, r.model.num_cached);
        Ok(())
    }

    /// Invariant 9: refused (and no change) while any block is held; else forgets every hash.
    fn reset_prefix_cache(&mut self) -> Result<(), TestCaseError> {
        let before = Snapshot::take(&self.mgr, &self.live);
        let expected = self.model.reset_prefix_cache();
        let got = self.mgr.reset_prefix_cache();
        prop_assert_eq!(got, expected, "reset_prefix_cache result");
        let after = Snapshot::take(&self.mgr, &self.live);
        if got {
            bump(&self.coverage.resets);
            prop_assert!(after.hashes.iter().all(Option::is_none));
            prop_assert_eq!(self.mgr.pool().num_cached_blocks(), 0);
            prop_assert_eq!(after.free, before.free, "reset keeps the free-queue order");
        } else {
            bump(&self.coverage.refused_resets);
            prop_assert_eq!(after, before, "a refused reset changed state");
        }
        Ok(())
    }
}

fn extra_of(lora: Option<u8>, salt: Option<u8>) -> ExtraKeys {
    ExtraKeys {
        lora_name: lora.map(|l| format!("lora-{l}")),
        cache_salt: salt.map(|s| format!("salt-{s}")),
        ..Default::default()
    }
}

fn empty_content() -> Content {
    Content {
        lora: None,
        salt: None,
        extra: ExtraKeys::default(),
        tokens: Vec::new(),
        hashes: Vec::new(),
    }
}

fn run_case(cfg: Config, ops: &[Op], coverage: &Coverage) -> Result<(), TestCaseError> {
    let mut harness = Harness::new(cfg, coverage);
    check_all(&harness.mgr, &harness.model, &harness.live)?;
    for op in ops {
        harness.apply(op)?;
    }
    // Finishing everything returns the pool to all-free, and the cache can then be reset.
    while let Some(i) = harness.live.len().checked_sub(1) {
        harness.free(i)?;
        harness.live.pop();
        check_all(&harness.mgr, &harness.model, &harness.live)?;
    }
    prop_assert_eq!(harness.mgr.num_free_blocks(), harness.cfg.num_blocks - 1);
    prop_assert!(harness.mgr.reset_prefix_cache());
    Ok(())
}

#[test]
fn kv_manager_matches_reference_model() {
    let coverage = Coverage::default();
    let mut runner = TestRunner::new(proptest_config(STATE_MACHINE_CASES));
    let strategy = (config_strategy(), vec(op_strategy(), 1..=100));
    let result = runner.run(&strategy, |(cfg, ops)| run_case(cfg, &ops, &coverage));
    if let Err(e) = result {
        panic!("{e}");
    }
    println!(
        "coverage over {} cases: {coverage:?}",
        runner.config().cases
    );
    // A generator that stops producing these would make the test vacuous.
    if runner.config().cases >= 1000 {
        for (name, counter) in [
            ("prefix hits", &coverage.hits),
            (
                "hits on free (evictable) blocks",
                &coverage.hits_on_free_blocks,
            ),
            ("successful allocations", &coverage.allocated),
            ("allocations that did not fit", &coverage.no_room),
            ("allocations past max_model_len", &coverage.too_long),
            (
                "allocations that evicted cached blocks",
                &coverage.evictions,
            ),
            ("duplicate cache keys", &coverage.duplicate_keys),
            ("prefix-cache resets", &coverage.resets),
            ("refused prefix-cache resets", &coverage.refused_resets),
            ("refused invalid calls", &coverage.refused_misuse),
            ("withdrawn cache entries", &coverage.withdrawn_entries),
        ] {
            assert!(counter.get() > 0, "no case exercised {name}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Hashing (invariant 8) and the free queue on their own
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum HashChange {
    Token { at: Index, delta: u32 },
    Lora,
    Salt,
}

proptest! {
    #![proptest_config(proptest_config(1000))]

    /// Invariant 8: block i's hash depends on every token of blocks 0..=i and on the extra keys;
    /// hashing incrementally gives the same chain as hashing at once.
    #[test]
    fn block_hash_chain_depends_on_every_earlier_token(
        algo in prop::sample::select(ALGOS.to_vec()),
        block_size in prop::sample::select(BLOCK_SIZES.to_vec()),
        tokens in vec(0u32..ALPHABET, 1..80),
        lora in prop::option::of(0u8..2),
        salt in prop::option::of(0u8..2),
        change in prop_oneof![
            4 => (any::<Index>(), 1u32..ALPHABET).prop_map(|(at, delta)| HashChange::Token { at, delta }),
            1 => Just(HashChange::Lora),
            1 => Just(HashChange::Salt),
        ],
    ) {
        let hasher = BlockHasher::new(algo, block_size, b"seed");
        let content = Content {
            lora,
            salt,
            extra: extra_of(lora, salt),
            tokens: tokens.clone(),
            hashes: Vec::new(),
        };
        let extra = content.extra_keys();
        let mut batch = Vec::new();
        hasher.extend_hashes(&mut batch, &tokens, &extra);
        prop_assert_eq!(batch.len(), tokens.len() / block_size, "only full blocks are hashed");
        let mut incremental = Vec::new();
        for n in 0..=tokens.len() {
            hasher.extend_hashes(&mut incremental, &tokens[..n], &extra);
        }
        prop_assert_eq!(&incremental, &batch);

        let mut changed_tokens = tokens.clone();
        let mut changed_extra = extra.clone();
        let first_changed_block = match change {
            HashChange::Token { at, delta } => {
                let p = at.index(tokens.len());
                changed_tokens[p] = (tokens[p] + delta) % ALPHABET;
                p / block_size
            }
            HashChange::Lora => {
                changed_extra.lora_name = Some(format!("other-{:?}", extra.lora_name));
                0
            }
            HashChange::Salt => {
                changed_extra.cache_salt = Some(format!("other-{:?}", extra.cache_salt));
                0
            }
        };
        let mut changed = Vec::new();
        hasher.extend_hashes(&mut changed, &changed_tokens, &changed_extra);
        for (i, (a, b)) in batch.iter().zip(&changed).enumerate() {
            if i < first_changed_block {
                prop_assert_eq!(a, b, "block {} precedes the change", i);
            } else {
                prop_assert_ne!(a, b, "block {} follows the change", i);
            }
        }
    }

    /// The intrusive free queue behaves as a deque with O(1) removal from the middle.
    #[test]
    fn free_queue_matches_deque(
        num_blocks in 1usize..40,
        ops in vec((0u8..4, any::<Index>()), 0..200),
    ) {
        let mut queue = FreeQueue::new(num_blocks, 0..num_blocks as u32);
        let mut model: VecDeque<u32> = (0..num_blocks as u32).collect();
        for (kind, pick) in ops {
            let outside: Vec<u32> = (0..num_blocks as u32).filter(|b| !model.contains(b)).collect();
            match kind {
                0 => prop_assert_eq!(queue.pop_front(), model.pop_front()),
                1 if !model.is_empty() => {
                    let b = model.remove(pick.index(model.len())).unwrap();
                    queue.remove(b);
                }
                2 if !outside.is_empty() => {
                    let b = outside[pick.index(outside.len())];
                    queue.push_back(b);
                    model.push_back(b);
                }
                3 if !outside.is_empty() => {
                    let b = outside[pick.index(outside.len())];
                    queue.push_front(b);
                    model.push_front(b);
                }
                _ => {}
            }
            prop_assert_eq!(queue.iter().collect::<Vec<_>>(), model.iter().copied().collect::<Vec<_>>());
            prop_assert_eq!(queue.len(), model.len());
            prop_assert_eq!(queue.front(), model.front().copied());
            for b in 0..num_blocks as u32 {
                prop_assert_eq!(queue.contains(b), model.contains(&b));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Pinned examples: the worked arithmetic of the spec (§2.9)
// ---------------------------------------------------------------------------------------------

fn allocate(
    mgr: &mut KvCacheManager,
    req: &mut RequestBlocks,
    content: &Content,
    args: AllocateArgs<'_>,
) -> Option<usize> {
    mgr.allocate_slots(req, content.view(), args)
        .expect("valid arguments")
}

fn hashed(tokens: Vec<u32>, block_size: usize) -> Content {
    let mut content = Content {
        lora: None,
        salt: None,
        extra: ExtraKeys::default(),
        tokens,
        hashes: Vec::new(),
    };
    let hasher = BlockHasher::new(HashAlgo::Sha256, block_size, b"pinned");
    let extra = content.extra_keys();
    hasher.extend_hashes(&mut content.hashes, &content.tokens, &extra);
    content
}

#[test]
fn worked_allocation_arithmetic() {
    let mut mgr = KvCacheManager::new(32, 16, 1024, true).unwrap();
    // 55-token prompt, cold: 4 blocks, 3 cached.
    let mut a = hashed((0..55).collect(), 16);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (4, 3));
    // + 4 decode tokens (59 known): no new block, still 3 cached.
    a = hashed((0..59).collect(), 16);
    let args = AllocateArgs {
        num_new_tokens: 4,
        num_computed_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(4));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (4, 3));
    // + 19 tokens (78 known): 5 blocks, 4 cached.
    a = hashed((0..78).collect(), 16);
    let args = AllocateArgs {
        num_new_tokens: 19,
        num_computed_tokens: 59,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(4));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (5, 4));
    // 53-token prompt sharing 48: 3 hits + 1 new block.
    let b = hashed((0..48).chain(900..905).collect(), 16);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 48);
    assert_eq!(hits, req_a.block_ids[..3]);
    let mut req_b = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 5,
        num_new_computed_tokens: 48,
        new_computed_blocks: &hits,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, args), Some(3));
    assert_eq!(req_b.block_ids.len(), 4);
    // DFlash K=3, 16-token prompt, first prefill with K+1 lookahead: 2 blocks, 1 cached.
    let c = hashed((2000..2016).collect(), 16);
    let mut req_c = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 16,
        num_lookahead_tokens: 4,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_c, &c, args), Some(0));
    assert_eq!((req_c.block_ids.len(), req_c.num_cached_blocks), (2, 1));
    mgr.check_invariants([&req_a, &req_b, &req_c]).unwrap();

    // test_allocate_with_lookahead: block 4, 3 new tokens, lookahead 2 or 4 -> 2 blocks.
    for lookahead in [2, 4] {
        let mut mgr = KvCacheManager::new(11, 4, 1024, true).unwrap();
        let d = hashed(vec![1, 2, 3], 4);
        let mut req = RequestBlocks::default();
        let args = AllocateArgs {
            num_new_tokens: 3,
            num_lookahead_tokens: lookahead,
            ..Default::default()
        };
        assert_eq!(allocate(&mut mgr, &mut req, &d, args), Some(0));
        assert_eq!(req.block_ids.len(), 2);
    }
}

/// test_evictable_cached_blocks_not_double_allocated: adopting free cached hits costs capacity.
#[test]
fn evictable_hits_count_against_capacity() {
    let mut mgr = KvCacheManager::new(5, 2, 1024, true).unwrap(); // 4 usable blocks
    let a = hashed(vec![1, 2, 3, 4, 5], 2);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 5,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    mgr.free(&mut req_a); // 3 blocks, 2 of them cached and evictable; 4 free in all
    let b = hashed(vec![1, 2, 3, 4, 9, 9, 9, 9], 2);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 4);
    // 8 tokens = 4 blocks: 2 adopted (free, so they cost 2) + 2 new = 4 <= 4 free: fits...
    let mut req_b = RequestBlocks::default();
    let fits = AllocateArgs {
        num_new_tokens: 4,
        num_new_computed_tokens: 4,
        new_computed_blocks: &hits,
        ..Default::default()
    };
    let snapshot = mgr.clone();
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, fits), Some(2));
    // ...but one lookahead slot more needs a 5th block, and nothing may change.
    let mut mgr = snapshot;
    let mut req_b = RequestBlocks::default();
    let too_big = AllocateArgs {
        num_lookahead_tokens: 1,
        ..fits
    };
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, too_big), None);
    assert_eq!(req_b, RequestBlocks::default());
    assert_eq!(mgr.num_free_blocks(), 4);
    mgr.check_invariants([&req_b]).unwrap();
}

#[test]
fn the_eagle_block_drop_gives_back_the_last_hit_block() {
    let mut mgr = KvCacheManager::new(32, 16, 1024, true).unwrap();
    let a = hashed((0..55).collect(), 16);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    let b = hashed((0..48).chain(900..905).collect(), 16);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 48);
    mgr.set_drop_last_hit_block(true);
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 32);
    assert_eq!(hits, req_a.block_ids[..2]);
    // A one-block hit drops to none.
    let c = hashed((0..16).chain(700..710).collect(), 16);
    assert_eq!(mgr.get_computed_blocks(c.view(), &mut hits), 0);
    assert!(hits.is_empty());
}
