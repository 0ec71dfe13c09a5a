//! `kv_ops`: random operation sequences on [`KvCacheManager`], the way an engine with its own
//! scheduler drives it through `dflash_rs.KVCacheManager` (requests registered with their
//! tokens, prefix lookups, `allocate_slots`, accepted tokens appended, preemption, free, prefix
//! cache reset), plus raw `allocate_slots` calls with arbitrary (often invalid) arguments.
//!
//! Checked after every operation:
//! - `KvCacheManager::check_invariants` over every live request's blocks: null block, free
//!   queue <=> ref count 0, free + used == usable, ref count == number of holders, hashed <=>
//!   in the prefix map, no unhashed block shared, cached prefix blocks hashed;
//! - content: a hashed block at index `i` of a request carries that request's `i`-th block hash
//!   (so a prefix hit never returns another prefix's KV); computed tokens lie in owned slots;
//! - a well-formed step (what a correct scheduler passes) never returns an error, allocates
//!   exactly `cdiv(min(computed + hits + new + lookahead, max_model_len), block_size)` blocks,
//!   and returns `None` exactly when the free blocks do not suffice;
//! - every call that fails (`Err` or `Ok(None)`) leaves the manager and the request unchanged;
//! - prefix lookups are block aligned, capped at `num_tokens - 1`, and index aligned;
//! - `reset_prefix_cache` succeeds exactly when no block is held, and then empties the cache.

use std::hash::{DefaultHasher, Hash, Hasher};

use arbitrary::{Arbitrary, Unstructured};
use dflash_core::{
    cdiv, AllocateArgs, BlockHash, BlockHasher, ExtraKeys, HashAlgo, KvCacheManager, RequestBlocks,
    SequenceView,
};

use crate::prompt_tokens;

/// Operations decoded from one input at most (bounds the time per input).
pub const MAX_OPS: usize = 256;
/// Live requests at most.
const MAX_REQUESTS: usize = 12;
const BLOCK_SIZES: [usize; 6] = [1, 2, 3, 4, 8, 16];
/// Block hashers; `TestCollide` (dflash-core feature `fault-injection`) hashes every block to
/// the same value, so only hit verification keeps prefixes apart.
const ALGOS: [HashAlgo; 4] = [
    HashAlgo::Xxh3_128,
    HashAlgo::Sha256,
    HashAlgo::Blake3,
    HashAlgo::TestCollide,
];

/// Pool shape and caching.
#[derive(Arbitrary, Debug, Clone)]
pub struct KvConfig {
    num_blocks: u8,
    block_size: u8,
    mml_blocks: u8,
    mml_extra: u8,
    no_caching: u8,
    algo: u8,
}

/// A count argument of a raw `allocate_slots` call.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Num {
    /// A small value.
    Small(u8),
    /// Near the natural value for this argument.
    Near(i8),
    /// Anywhere in `u32`.
    Big(u32),
    /// Anywhere in `usize` (the Rust API takes any `usize`).
    Huge(u64),
}

/// Where the prefix-hit blocks of a raw call come from.
#[derive(Arbitrary, Debug, Clone)]
pub enum Hits {
    /// None.
    None,
    /// This request's real prefix hits, the first `n` of them.
    Lookup(u8),
    /// Arbitrary block ids.
    Garbage(Vec<u8>),
    /// Another request's blocks.
    Other(u8),
}

/// One operation.
#[derive(Arbitrary, Debug, Clone)]
pub enum KvOp {
    /// Register a request: a prefix of shared template `template`, then pseudo-random tokens.
    Add {
        template: u8,
        prefix: u8,
        suffix: u8,
        seed: u8,
        lora: Option<bool>,
        salt: Option<bool>,
    },
    /// Accepted tokens of a decode step.
    Append { req: u8, n: u8, seed: u8 },
    /// One well-formed scheduler step: prefix lookup when the request holds no blocks, then
    /// `allocate_slots` for a prompt chunk (or 1 + drafts) plus lookahead.
    Step {
        req: u8,
        chunk: u8,
        drafts: u8,
        lookahead: u8,
        must_fit: bool,
        read_cache: bool,
    },
    /// Rejected drafts: roll back computed tokens (blocks are kept).
    Reject { req: u8, n: u8 },
    /// A prefix lookup alone.
    Lookup { req: u8 },
    /// `allocate_slots` with arbitrary arguments (`new_computed: None` = consistent with hits).
    Raw {
        req: u8,
        num_new: Num,
        computed: Num,
        new_computed: Option<Num>,
        hits: Hits,
        lookahead: Num,
        must_fit: bool,
        seq_tokens: Option<Num>,
    },
    /// Free the request's blocks but keep it (recompute preemption).
    Preempt { req: u8 },
    /// Free the request's blocks and forget it.
    Free { req: u8 },
    /// Withdraw cache entries registered from block `from` on, then preempt (the scheduler's
    /// undo of a priority victim).
    UndoAndPreempt { req: u8, from: u8 },
    /// Empty the prefix cache.
    Reset,
}

/// The whole input.
#[derive(Debug, Clone)]
pub struct KvInput {
    /// Pool shape.
    pub config: KvConfig,
    /// Operations in order.
    pub ops: Vec<KvOp>,
}

impl KvInput {
    /// Decodes as much as the bytes give (missing bytes read as zeros).
    pub fn decode(data: &[u8]) -> Self {
        let mut u = Unstructured::new(data);
        let config = KvConfig::arbitrary(&mut u).unwrap_or(KvConfig {
            num_blocks: 0,
            block_size: 0,
            mml_blocks: 0,
            mml_extra: 0,
            no_caching: 0,
            algo: 0,
        });
        let mut ops = Vec::new();
        while !u.is_empty() && ops.len() < MAX_OPS {
            match KvOp::arbitrary(&mut u) {
                Ok(op) => ops.push(op),
                Err(_) => break,
            }
        }
        Self { config, ops }
    }
}

/// What a run did (for the seed generator and tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvStats {
    /// Requests registered.
    pub adds: u32,
    /// Well-formed steps that got slots.
    pub steps_ok: u32,
    /// Well-formed steps refused for lack of blocks.
    pub steps_none: u32,
    /// Prefix-hit blocks adopted.
    pub hit_blocks: u32,
    /// Raw calls that succeeded / were refused / failed.
    pub raw_ok: u32,
    /// Raw calls refused for lack of blocks.
    pub raw_none: u32,
    /// Raw calls that returned an error.
    pub raw_err: u32,
    /// Preemptions (incl. undo).
    pub preempts: u32,
    /// Successful prefix-cache resets.
    pub resets: u32,
    /// Whether the manager was built.
    pub built: bool,
}

#[derive(Debug, Clone)]
struct Req {
    tokens: Vec<u32>,
    hashes: Vec<BlockHash>,
    extra: ExtraKeys,
    blocks: RequestBlocks,
    /// Tokens whose KV the caller considers computed.
    computed: usize,
    /// Identity of the prefix through the end of each full block (tokens and tenant keys),
    /// computed here independently of the core's hashers: the model of what a block's KV is.
    truth: Vec<u64>,
}

impl Req {
    fn view(&self) -> SequenceView<'_> {
        SequenceView {
            tokens: &self.tokens,
            block_hashes: &self.hashes,
            extra: &self.extra,
        }
    }

    /// Extends `truth` to every full block of the tokens.
    fn extend_truth(&mut self, bs: usize) {
        for j in self.truth.len()..self.tokens.len() / bs {
            let mut h = DefaultHasher::new();
            self.truth.last().hash(&mut h);
            self.tokens[j * bs..(j + 1) * bs].hash(&mut h);
            self.extra.lora_name.hash(&mut h);
            self.extra.cache_salt.hash(&mut h);
            self.truth.push(h.finish());
        }
    }
}

struct Harness {
    allow: crate::Allow,
    kv: KvCacheManager,
    hasher: BlockHasher,
    caching: bool,
    bs: usize,
    mml: usize,
    reqs: Vec<Req>,
    hits: Vec<u32>,
    stats: KvStats,
    /// Prefix identity (`Req::truth`) of the KV each cached block holds, by block id.
    content: Vec<Option<u64>>,
    /// Whether a prefix hit must hold exactly the request's prefix: always with hit
    /// verification, and without it unless the hash collides on purpose.
    exact_hits: bool,
}

/// Runs one input; panics on a finding.
pub fn run(data: &[u8]) -> KvStats {
    run_with(data, crate::Allow::from_env())
}

/// Runs one input, tolerating the known findings in `allow`; panics on any other finding.
pub fn run_with(data: &[u8], allow: &crate::Allow) -> KvStats {
    run_input_with(&KvInput::decode(data), allow)
}

/// Runs a decoded input strictly (every finding is a panic).
pub fn run_input(input: &KvInput) -> KvStats {
    run_input_with(input, &crate::Allow::none())
}

/// Runs a decoded input, tolerating the known findings in `allow`.
pub fn run_input_with(input: &KvInput, allow: &crate::Allow) -> KvStats {
    let c = &input.config;
    let num_blocks = usize::from(c.num_blocks % 40);
    let bs = BLOCK_SIZES[usize::from(c.block_size) % BLOCK_SIZES.len()];
    let mml = usize::from(c.mml_blocks % 48) * bs + usize::from(c.mml_extra) % bs;
    let caching = !c.no_caching.is_multiple_of(5);
    let algo = ALGOS[usize::from(c.algo) % ALGOS.len()];
    let verify = !(c.algo >> 2).is_multiple_of(4);
    let kv = match KvCacheManager::new(num_blocks, bs, mml, caching) {
        Ok(kv) => kv,
        Err(e) => {
            assert!(
                num_blocks < 2 || mml == 0,
                "KvCacheManager::new({num_blocks}, {bs}, {mml}) failed: {e}"
            );
            return KvStats::default();
        }
    };
    assert!(
        num_blocks >= 2 && mml > 0,
        "KvCacheManager::new accepted a bad shape"
    );
    let mut kv = kv;
    if let Err(e) = kv.set_verify_hits(verify) {
        panic!("set_verify_hits({verify}) on an empty cache failed: {e}");
    }
    let mut h = Harness {
        allow: allow.clone(),
        kv,
        hasher: BlockHasher::new(algo, bs, b"fuzz"),
        caching,
        bs,
        mml,
        reqs: Vec::new(),
        hits: Vec::new(),
        content: vec![None; num_blocks],
        exact_hits: verify || algo != HashAlgo::TestCollide,
        stats: KvStats {
            built: true,
            ..Default::default()
        },
    };
    h.check("new");
    for (i, op) in input.ops.iter().enumerate() {
        h.apply(op);
        h.check(&format!("op {i} {op:?}"));
    }
    // Free everything: the pool must be whole again.
    for mut r in std::mem::take(&mut h.reqs) {
        h.kv.free(&mut r.blocks);
    }
    h.check("final free");
    assert_eq!(
        h.kv.num_free_blocks(),
        num_blocks - 1,
        "blocks leaked after every request was freed"
    );
    h.stats
}

/// Debug rendering of the whole manager state and one request's blocks, for "nothing
/// changed" checks (prefix-lookup counters excluded: lookups count even when nothing else
/// changes).
fn snapshot(kv: &KvCacheManager, blocks: &RequestBlocks) -> String {
    format!("{:?}\n{blocks:?}", kv.pool())
}

impl Harness {
    fn pick(&self, req: u8) -> Option<usize> {
        (!self.reqs.is_empty()).then(|| usize::from(req) % self.reqs.len())
    }

    fn apply(&mut self, op: &KvOp) {
        match *op {
            KvOp::Add {
                template,
                prefix,
                suffix,
                seed,
                lora,
                salt,
            } => {
                if self.reqs.len() >= MAX_REQUESTS {
                    return;
                }
                let prefix = usize::from(prefix) % (self.mml + 2);
                let suffix = usize::from(suffix % 32);
                let tokens = prompt_tokens(template, prefix, suffix, u32::from(seed));
                // The binding refuses empty prompts and prompts past max_model_len.
                if tokens.is_empty() || tokens.len() > self.mml {
                    return;
                }
                let extra = ExtraKeys {
                    lora_name: lora.map(|b| if b { "a" } else { "b" }.to_owned()),
                    cache_salt: salt.map(|b| if b { "x" } else { "y" }.to_owned()),
                    ..Default::default()
                };
                let mut hashes = Vec::new();
                if self.caching {
                    self.hasher.extend_hashes(&mut hashes, &tokens, &extra);
                }
                let mut r = Req {
                    tokens,
                    hashes,
                    extra,
                    blocks: RequestBlocks::default(),
                    computed: 0,
                    truth: Vec::new(),
                };
                r.extend_truth(self.bs);
                self.reqs.push(r);
                self.stats.adds += 1;
            }
            KvOp::Append { req, n, seed } => {
                let Some(i) = self.pick(req) else { return };
                let r = &mut self.reqs[i];
                let n = usize::from(n % 9).min(self.mml - r.tokens.len());
                let mut x = crate::Lcg::new(u32::from(seed));
                r.tokens.extend((0..n).map(|_| 100 + x.next() % 7));
                if self.caching {
                    self.hasher
                        .extend_hashes(&mut r.hashes, &r.tokens, &r.extra);
                }
                r.extend_truth(self.bs);
            }
            KvOp::Step {
                req,
                chunk,
                drafts,
                lookahead,
                must_fit,
                read_cache,
            } => self.step(req, chunk, drafts, lookahead, must_fit, read_cache),
            KvOp::Reject { req, n } => {
                let Some(i) = self.pick(req) else { return };
                let r = &mut self.reqs[i];
                r.computed -= usize::from(n).min(r.computed);
            }
            KvOp::Lookup { req } => {
                let Some(i) = self.pick(req) else { return };
                self.lookup(i);
            }
            KvOp::Raw {
                req,
                num_new,
                computed,
                new_computed,
                ref hits,
                lookahead,
                must_fit,
                seq_tokens,
            } => self.raw(
                req,
                num_new,
                computed,
                new_computed,
                hits,
                lookahead,
                must_fit,
                seq_tokens,
            ),
            KvOp::Preempt { req } => {
                let Some(i) = self.pick(req) else { return };
                let r = &mut self.reqs[i];
                self.kv.free(&mut r.blocks);
                r.computed = 0;
                assert!(r.blocks.block_ids.is_empty() && r.blocks.num_cached_blocks == 0);
                self.stats.preempts += 1;
            }
            KvOp::Free { req } => {
                let Some(i) = self.pick(req) else { return };
                let mut r = self.reqs.swap_remove(i);
                self.kv.free(&mut r.blocks);
                assert!(r.blocks.block_ids.is_empty() && r.blocks.num_cached_blocks == 0);
            }
            KvOp::UndoAndPreempt { req, from } => {
                let Some(i) = self.pick(req) else { return };
                let r = &mut self.reqs[i];
                let from = usize::from(from) % (r.blocks.block_ids.len() + 2);
                let cached_before = r.blocks.num_cached_blocks;
                let sole: Vec<u32> = r
                    .blocks
                    .block_ids
                    .iter()
                    .enumerate()
                    .filter(|&(j, &b)| {
                        j >= from && j < cached_before && self.kv.pool().ref_count(b) == 1
                    })
                    .map(|(_, &b)| b)
                    .collect();
                self.kv.uncache_blocks(&mut r.blocks, from);
                assert_eq!(r.blocks.num_cached_blocks, cached_before.min(from));
                for b in sole {
                    assert!(
                        self.kv.pool().block_hash(b).is_none(),
                        "uncache_blocks kept the hash of block {b}, held by this request alone"
                    );
                }
                self.kv.free(&mut r.blocks);
                r.computed = 0;
                self.stats.preempts += 1;
            }
            KvOp::Reset => {
                let held = self.reqs.iter().any(|r| !r.blocks.block_ids.is_empty());
                let before = snapshot(&self.kv, &RequestBlocks::default());
                let ok = self.kv.reset_prefix_cache();
                assert_eq!(
                    ok, !held,
                    "reset_prefix_cache returned {ok} while blocks held = {held}"
                );
                if ok {
                    self.content.iter_mut().for_each(|c| *c = None);
                    self.stats.resets += 1;
                    assert_eq!(self.kv.pool().num_cached_blocks(), 0);
                    for r in &self.reqs {
                        if let Some(h) = r.hashes.first() {
                            assert_eq!(self.kv.pool().get_cached_block(h), None);
                        }
                    }
                } else {
                    assert_eq!(before, snapshot(&self.kv, &RequestBlocks::default()));
                }
            }
        }
    }

    /// Prefix lookup for request `i`; checks the result and returns the hit length.
    fn lookup(&mut self, i: usize) -> usize {
        let r = &self.reqs[i];
        let before = snapshot(&self.kv, &r.blocks);
        let hit = self.kv.get_computed_blocks(r.view(), &mut self.hits);
        assert_eq!(
            before,
            snapshot(&self.kv, &r.blocks),
            "get_computed_blocks changed the pool"
        );
        assert_eq!(
            hit,
            self.hits.len() * self.bs,
            "hit length not block aligned"
        );
        if !self.caching {
            assert_eq!(hit, 0, "prefix hit with caching off");
        }
        assert!(
            hit == 0 || hit < r.tokens.len(),
            "hit of {hit} tokens not below the {} known tokens",
            r.tokens.len()
        );
        for (j, &b) in self.hits.iter().enumerate() {
            assert_eq!(
                self.kv.pool().block_hash(b),
                r.hashes.get(j),
                "hit block {b} at index {j} carries another prefix's hash"
            );
            if self.exact_hits {
                assert_eq!(
                    self.content[b as usize],
                    r.truth.get(j).copied(),
                    "prefix hit: block {b} at index {j} holds the KV of another prefix or tenant"
                );
            }
        }
        hit
    }

    fn step(
        &mut self,
        req: u8,
        chunk: u8,
        drafts: u8,
        lookahead: u8,
        must_fit: bool,
        read_cache: bool,
    ) {
        let Some(i) = self.pick(req) else { return };
        let (bs, mml) = (self.bs, self.mml);
        let fresh = self.reqs[i].blocks.block_ids.is_empty() && self.reqs[i].computed == 0;
        let mut hit = 0;
        self.hits.clear();
        if fresh && read_cache {
            hit = self.lookup(i);
        }
        let r = &mut self.reqs[i];
        let start = r.computed + hit;
        let known_left = r.tokens.len().saturating_sub(start);
        let chunk = usize::from(chunk % 24);
        let mut num_new = if known_left == 0 {
            1
        } else if chunk > 0 {
            known_left.min(chunk)
        } else {
            known_left
        };
        if num_new >= known_left {
            num_new += usize::from(drafts % 10);
        }
        num_new = num_new.min(mml.saturating_sub(start));
        if num_new == 0 {
            return;
        }
        let lookahead = usize::from(lookahead % 21);
        let args = AllocateArgs {
            num_new_tokens: num_new,
            num_computed_tokens: r.computed,
            num_new_computed_tokens: hit,
            new_computed_blocks: &self.hits,
            num_lookahead_tokens: lookahead,
            full_sequence_must_fit: must_fit,
        };
        // What the pool must give up (model of vLLM's get_num_blocks_to_allocate).
        let held = r.blocks.block_ids.len();
        let need = |slots: usize| {
            let required = cdiv(slots, bs);
            if held > 0 {
                required.saturating_sub(held)
            } else {
                let evictable = self
                    .hits
                    .iter()
                    .filter(|&&b| self.kv.pool().ref_count(b) == 0)
                    .count();
                required.saturating_sub(self.hits.len()) + evictable
            }
        };
        let need_slot = (start + num_new + lookahead).min(mml);
        let free = self.kv.num_free_blocks();
        let fits = need(need_slot) <= free && (!must_fit || need(r.tokens.len().min(mml)) <= free);
        let before = snapshot(&self.kv, &r.blocks);
        let cached_before = r.blocks.num_cached_blocks;
        let view = SequenceView {
            tokens: &r.tokens,
            block_hashes: &r.hashes,
            extra: &r.extra,
        };
        let res = self.kv.allocate_slots(&mut r.blocks, view, args);
        match res {
            Err(e) => panic!("well-formed allocate_slots({args:?}) failed: {e}"),
            Ok(None) => {
                assert!(
                    !fits,
                    "allocate_slots refused although {free} free blocks suffice"
                );
                assert_eq!(
                    before,
                    snapshot(&self.kv, &r.blocks),
                    "refused allocate_slots changed state"
                );
                self.stats.steps_none += 1;
            }
            Ok(Some(first_new)) => {
                assert!(fits, "allocate_slots succeeded with too few free blocks");
                assert_eq!(first_new, held + self.hits.len(), "first new block index");
                assert_eq!(
                    &r.blocks.block_ids[held..held + self.hits.len()],
                    self.hits.as_slice(),
                    "hit blocks not adopted in order"
                );
                let expect = (held + self.hits.len()).max(cdiv(need_slot, bs));
                assert_eq!(
                    r.blocks.block_ids.len(),
                    expect,
                    "block count after allocate_slots (need_slot {need_slot})"
                );
                for &b in &r.blocks.block_ids[first_new..] {
                    assert_eq!(self.kv.pool().ref_count(b), 1, "new block {b} ref count");
                }
                if self.caching {
                    let full = (start + num_new).min(r.tokens.len()) / bs;
                    assert_eq!(
                        r.blocks.num_cached_blocks,
                        cached_before.max(self.hits.len()).max(full),
                        "cached block count"
                    );
                }
                self.stats.hit_blocks += self.hits.len() as u32;
                r.computed = start + num_new;
                self.stats.steps_ok += 1;
                self.record_content(i, first_new);
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn raw(
        &mut self,
        req: u8,
        num_new: Num,
        computed: Num,
        new_computed: Option<Num>,
        hits: &Hits,
        lookahead: Num,
        must_fit: bool,
        seq_tokens: Option<Num>,
    ) {
        let Some(i) = self.pick(req) else { return };
        self.hits.clear();
        match hits {
            Hits::None => {}
            Hits::Lookup(n) => {
                self.lookup(i);
                self.hits.truncate(usize::from(*n));
            }
            Hits::Garbage(ids) => self.hits.extend(ids.iter().map(|&b| u32::from(b))),
            Hits::Other(j) => {
                let j = usize::from(*j) % self.reqs.len();
                self.hits.extend_from_slice(&self.reqs[j].blocks.block_ids);
            }
        }
        let bs = self.bs;
        let r = &mut self.reqs[i];
        // Known finding `allocate-overflow` (docs/FUZZING.md): counts near usize::MAX overflow
        // inside allocate_slots. When tolerated, stay in the binding's domain (<= i64::MAX).
        let cap = if self.allow.has("allocate-overflow") {
            i64::MAX as usize
        } else {
            usize::MAX
        };
        let resolve = |n: Num, natural: usize| -> usize {
            match n {
                Num::Small(v) => usize::from(v),
                Num::Near(d) => natural.saturating_add_signed(isize::from(d)),
                Num::Big(v) => v as usize,
                Num::Huge(v) => (v as usize).min(cap),
            }
        };
        let computed = resolve(computed, r.computed);
        let hit = match new_computed {
            None => self.hits.len() * bs,
            Some(n) => resolve(n, self.hits.len() * bs),
        };
        let num_new = resolve(num_new, r.tokens.len().saturating_sub(computed).max(1));
        let lookahead = resolve(lookahead, 0);
        let num_tokens = match seq_tokens {
            None => r.tokens.len(),
            // Never more known tokens than hashes cover: a caller cannot invent tokens.
            Some(n) => resolve(n, r.tokens.len()).min(r.tokens.len()),
        };
        // A shortened sequence comes with the hashes of its full blocks only.
        let view = SequenceView {
            tokens: &r.tokens[..num_tokens],
            block_hashes: &r.hashes[..r.hashes.len().min(num_tokens / bs)],
            extra: &r.extra,
        };
        let args = AllocateArgs {
            num_new_tokens: num_new,
            num_computed_tokens: computed,
            num_new_computed_tokens: hit,
            new_computed_blocks: &self.hits,
            num_lookahead_tokens: lookahead,
            full_sequence_must_fit: must_fit,
        };
        let before = snapshot(&self.kv, &r.blocks);
        match self.kv.allocate_slots(&mut r.blocks, view, args) {
            Err(_) => {
                assert_eq!(
                    before,
                    snapshot(&self.kv, &r.blocks),
                    "failed allocate_slots({args:?}) changed state"
                );
                self.stats.raw_err += 1;
            }
            Ok(None) => {
                assert_eq!(
                    before,
                    snapshot(&self.kv, &r.blocks),
                    "refused allocate_slots({args:?}) changed state"
                );
                self.stats.raw_none += 1;
            }
            Ok(Some(first_new)) => {
                let end = computed
                    .checked_add(hit)
                    .and_then(|x| x.checked_add(num_new))
                    .filter(|&end| end <= self.mml);
                let Some(end) = end else {
                    panic!("allocate_slots({args:?}) accepted a sequence past max_model_len")
                };
                r.computed = end;
                self.stats.raw_ok += 1;
                self.record_content(i, first_new);
            }
        }
    }

    /// After a successful allocation for request `i`: blocks from `first_new` on are fresh (their
    /// old KV is gone); cached blocks that got their hash now hold this request's prefix.
    fn record_content(&mut self, i: usize, first_new: usize) {
        let r = &self.reqs[i];
        for &b in &r.blocks.block_ids[first_new..] {
            self.content[b as usize] = None;
        }
        for (j, &b) in r.blocks.block_ids[..r.blocks.num_cached_blocks]
            .iter()
            .enumerate()
        {
            if self.kv.pool().block_hash(b).is_some() && self.content[b as usize].is_none() {
                self.content[b as usize] = r.truth.get(j).copied();
            }
        }
    }

    /// Every invariant, after every operation.
    fn check(&self, ctx: &str) {
        if let Err(e) = self
            .kv
            .check_invariants(self.reqs.iter().map(|r| &r.blocks))
        {
            panic!("after {ctx}: {e}");
        }
        let pool = self.kv.pool();
        let used = (1..pool.num_blocks() as u32)
            .filter(|&b| pool.ref_count(b) > 0)
            .count();
        assert_eq!(
            used + pool.num_free_blocks(),
            pool.num_usable_blocks(),
            "after {ctx}: used + free != usable"
        );
        for (k, r) in self.reqs.iter().enumerate() {
            assert!(
                r.blocks.num_cached_blocks <= r.blocks.block_ids.len(),
                "after {ctx}: request {k} counts more cached blocks than it holds"
            );
            assert!(
                r.computed <= r.blocks.block_ids.len() * self.bs,
                "after {ctx}: request {k} has {} computed tokens in {} blocks",
                r.computed,
                r.blocks.block_ids.len()
            );
            for (j, &b) in r.blocks.block_ids.iter().enumerate() {
                if self.exact_hits && j < r.blocks.num_cached_blocks && pool.block_hash(b).is_some()
                {
                    assert_eq!(
                        self.content[b as usize],
                        r.truth.get(j).copied(),
                        "after {ctx}: request {k}'s cached block {b} at index {j} holds the KV \
                         of another prefix or tenant"
                    );
                }
                if let Some(h) = pool.block_hash(b) {
                    assert_eq!(
                        Some(h),
                        r.hashes.get(j),
                        "after {ctx}: request {k}'s block {b} at index {j} carries a hash that \
                         is not the request's block hash {j}"
                    );
                }
            }
        }
    }
}
