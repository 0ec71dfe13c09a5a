//! The block pool: per-block records (ref counts, prefix-cache entries), the free queue and
//! the prefix-cache map.
//!
//! Block 0 is the null block: never allocated, hashed or freed, so usable = `num_blocks - 1`.
//! A freed block keeps its hash and stays in the prefix map as an eviction candidate until it is
//! popped for reuse (which evicts the hash) or adopted again through [`BlockPool::touch`].

use crate::error::{broken, invalid, try_filled_vec, CoreError, CoreResult};
use crate::hashing::BlockHash;
use crate::hashing::ExtraKeys;
use crate::pool::block_meta::BlockMeta;
use crate::pool::free_queue::FreeQueue;
use crate::pool::kv_events::{KvEvent, KvEventLog};
use crate::pool::prefix_map::PrefixMap;
use crate::pool::provenance::{Fingerprint, Provenance};

/// The reserved null block.
pub const NULL_BLOCK: u32 = 0;

/// Fixed set of KV-cache blocks with ref counts, a free queue in eviction order and a prefix map.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Per block: ref count, and hash, fingerprint and chain links while cached.
    meta: Vec<BlockMeta>,
    free: FreeQueue,
    /// Hash -> cached blocks, and the hash each cached block carries.
    prefix: PrefixMap,
    enable_caching: bool,
    /// What cached blocks hold, to verify hits (None: hits are trusted on their hash alone).
    provenance: Option<Provenance>,
    /// Reused buffer of `free_blocks`.
    scratch: Vec<u32>,
    /// KV-cache events since the engine last took them; None while events are off.
    events: Option<Box<KvEventLog>>,
}

/// Where blocks being cached came from: the request's tokens, the logical index of the first
/// block, the request's block before it (`NULL_BLOCK` if none) and the request's extra keys.
#[derive(Debug, Clone, Copy)]
pub struct BlockSource<'a> {
    /// The request's tokens, at least up to the end of the last block being cached.
    pub tokens: &'a [u32],
    /// Logical index of the first block being cached.
    pub first: usize,
    /// The request's block before the first one.
    pub parent: u32,
    /// The request's extra keys.
    pub extra: &'a ExtraKeys,
    /// The fingerprint of the prefix before the first block, if the caller kept it (None:
    /// taken from the parent's entry, or recomputed from the tokens).
    pub parent_fingerprint: Option<Fingerprint>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks (block 0 reserved). Needs at least 2 blocks.
    pub fn new(num_blocks: usize, enable_caching: bool) -> CoreResult<Self> {
        if num_blocks < 2 {
            return Err(invalid!(
                "num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            ));
        }
        if num_blocks >= u32::MAX as usize - 2 {
            return Err(invalid!("num_blocks {num_blocks} is too large"));
        }
        Ok(Self {
            meta: try_filled_vec(num_blocks, BlockMeta::EMPTY, "block records")?,
            free: FreeQueue::try_new(num_blocks, 1..num_blocks as u32)?,
            prefix: PrefixMap::try_new(if enable_caching { num_blocks } else { 0 })?,
            enable_caching,
            provenance: None,
            scratch: Vec::new(),
            events: None,
        })
    }

    /// Bytes a pool of `num_blocks` blocks of `block_size` tokens allocates at construction,
    /// hit verification on (its token copies exist only with caching).
    pub fn bytes_for(num_blocks: usize, block_size: usize, caching: bool) -> u128 {
        let records = num_blocks as u128 * std::mem::size_of::<BlockMeta>() as u128;
        let cache = if caching {
            PrefixMap::bytes_for(num_blocks) + Provenance::bytes_for(num_blocks, block_size)
        } else {
            0
        };
        records
            .saturating_add(FreeQueue::bytes_for(num_blocks))
            .saturating_add(cache)
    }

    /// Turns verification of prefix-cache hits on (blocks of `block_size` tokens) or off. Only
    /// while nothing is cached; verification is what keeps a hash collision from sharing KV
    /// across prefixes or tenants (see `pool::provenance`).
    pub fn set_verify_hits(&mut self, block_size: Option<usize>) -> CoreResult<()> {
        if self.prefix.num_blocks() != 0 {
            return Err(invalid!(
                "hit verification can only change while the prefix cache is empty"
            ));
        }
        self.provenance = match block_size {
            Some(bs) if self.enable_caching => Some(Provenance::try_new(self.num_blocks(), bs)?),
            _ => None,
        };
        Ok(())
    }

    /// Whether prefix-cache hits are verified against the tokens they were cached with.
    pub fn verifies_hits(&self) -> bool {
        self.provenance.is_some()
    }

    /// Turns the KV-cache event log on (empty) or off (dropping what it held).
    pub fn set_kv_events(&mut self, on: bool) {
        self.events = on.then(Box::default);
    }

    /// Whether the KV-cache event log is on.
    #[inline]
    pub fn kv_events_on(&self) -> bool {
        self.events.is_some()
    }

    /// The KV-cache event log, while events are on.
    #[inline]
    pub fn kv_events_mut(&mut self) -> Option<&mut KvEventLog> {
        self.events.as_deref_mut()
    }

    /// Takes the KV-cache events recorded so far (none while events are off).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.events
            .as_deref_mut()
            .map(KvEventLog::take)
            .unwrap_or_default()
    }

    /// While events are on, records that `blocks` (logical blocks `first..` of a request whose
    /// block `first - 1` is `parent`, holding `tokens`, `block_size` each, followed by the
    /// `lookahead` tokens their hashes also cover) are about to be registered: one `Stored` per
    /// run of them not registered yet (a block whose entry a withdrawal kept, because another
    /// request holds it, stays as it is).
    pub fn record_stored(
        &mut self,
        first: usize,
        parent: u32,
        blocks: &[u32],
        tokens: &[u32],
        block_size: usize,
        lookahead: usize,
    ) {
        let Some(log) = self.events.as_deref_mut() else {
            return;
        };
        let new = |b: u32| b != NULL_BLOCK && !self.prefix.is_registered(&self.meta, b);
        let mut i = 0;
        while i < blocks.len() {
            if !new(blocks[i]) {
                i += 1;
                continue;
            }
            let start = i;
            while i < blocks.len() && new(blocks[i]) {
                i += 1;
            }
            let run_parent = if start == 0 {
                parent
            } else {
                blocks[start - 1]
            };
            let run_tokens = &tokens[start * block_size..i * block_size + lookahead];
            log.stored(first + start, run_parent, &blocks[start..i], run_tokens);
        }
    }

    /// Total blocks including the null block.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks that can ever be allocated (`num_blocks - 1`).
    pub fn num_usable_blocks(&self) -> usize {
        self.meta.len() - 1
    }

    /// Blocks in the free queue (free or evictable cached).
    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// Fraction of usable blocks in use, in [0, 1].
    pub fn usage(&self) -> f64 {
        1.0 - self.free.len() as f64 / self.num_usable_blocks() as f64
    }

    /// Whether the prefix cache is on.
    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    /// Ref count of `block`.
    pub fn ref_count(&self, block: u32) -> u32 {
        self.meta[block as usize].ref_cnt
    }

    /// Hash of `block`, if it is registered in the prefix cache.
    pub fn block_hash(&self, block: u32) -> Option<&BlockHash> {
        self.prefix.hash_of(&self.meta, block)
    }

    /// Number of (hash, block) registrations in the prefix cache.
    pub fn num_cached_blocks(&self) -> usize {
        self.prefix.num_blocks()
    }

    /// Free blocks from next-reused to last-reused.
    pub fn free_block_ids(&self) -> Vec<u32> {
        self.free.iter().collect()
    }

    /// The cached block for `hash`, if any.
    pub fn get_cached_block(&self, hash: &BlockHash) -> Option<u32> {
        if !self.enable_caching {
            return None;
        }
        self.prefix.get_one(&self.meta, hash)
    }

    /// The fingerprint of a prefix ending with a block of `tokens` (see
    /// `pool::provenance`), or None when hits are not verified.
    pub fn prefix_fingerprint(
        &self,
        parent: Option<Fingerprint>,
        tokens: &[u32],
        extra: &ExtraKeys,
        index: usize,
    ) -> Option<Fingerprint> {
        self.provenance
            .as_ref()
            .map(|p| p.chain(parent, tokens, extra, index))
    }

    /// The first block cached under `hash` that holds `tokens` at the end of the prefix
    /// `fingerprint` (from [`Self::prefix_fingerprint`]; None: the first block under `hash`).
    pub fn find_cached_block(
        &self,
        hash: &BlockHash,
        tokens: &[u32],
        fingerprint: Option<Fingerprint>,
    ) -> Option<u32> {
        if !self.enable_caching {
            return None;
        }
        match (&self.provenance, fingerprint) {
            (Some(_), Some(_)) => self
                .prefix
                .get_all(&self.meta, hash)
                .find(|&b| self.hit_matches(b, tokens, fingerprint)),
            _ => self.prefix.get_one(&self.meta, hash),
        }
    }

    /// Whether cached `block` holds `tokens` at the end of the prefix `fingerprint`; always
    /// true without verification.
    pub fn hit_matches(
        &self,
        block: u32,
        tokens: &[u32],
        fingerprint: Option<Fingerprint>,
    ) -> bool {
        match (&self.provenance, fingerprint) {
            (Some(prov), Some(fp)) => {
                self.prefix.fingerprint_of(&self.meta, block) == Some(fp)
                    && prov.holds(block, tokens)
            }
            _ => true,
        }
    }

    /// Pops `n` blocks from the head of the free queue, evicting their hashes, with ref count 1.
    /// Appends them to `out` in pop order. Fails without change if fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: usize, out: &mut Vec<u32>) -> CoreResult<()> {
        if n > self.free.len() {
            return Err(CoreError::OutOfBlocks(format!(
                "cannot get {n} blocks: only {} free",
                self.free.len()
            )));
        }
        out.reserve(n);
        let start = out.len();
        for _ in 0..n {
            let Some(b) = self.free.pop_front() else {
                return Err(broken!("free queue shorter than its length"));
            };
            self.meta[b as usize].ref_cnt = 1;
            out.push(b);
        }
        // The next calls pop the blocks right behind these (a decode step pops one block for
        // each of hundreds of requests): ask for their records now, a few pops ahead.
        for b in self
            .free
            .entries_ahead(crate::memory::prefetch::POP_DISTANCE, n)
        {
            crate::memory::prefetch::read(&self.meta[b as usize]);
        }
        let popped = &out[start..];
        if popped.len() > 1 {
            // Evicting a reused block's hash reads its prefix entry, then its bucket and chain
            // neighbours: prefetched in two waves, so a prefill's blocks overlap their misses.
            for &b in popped {
                crate::memory::prefetch::read(&self.meta[b as usize]);
            }
            for &b in popped {
                self.prefix.prefetch_remove(&self.meta, b);
            }
        }
        match self.events.as_deref_mut() {
            None => {
                for &b in popped {
                    // Most reused blocks were never registered: no call for them.
                    if self.prefix.is_registered(&self.meta, b) {
                        self.prefix.remove(&mut self.meta, b);
                    }
                }
            }
            Some(log) => {
                for &b in popped {
                    if self.prefix.remove(&mut self.meta, b).is_some() {
                        log.removed(b);
                    }
                }
            }
        }
        Ok(())
    }

    /// Adopts prefix-cache hits: free ones leave the free queue; every ref count goes up by one.
    pub fn touch(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            if self.meta[b as usize].ref_cnt == 0 {
                self.free.remove(b);
            }
            self.meta[b as usize].ref_cnt += 1;
        }
    }

    /// Drops one reference from each block, in the given order. Blocks that reach zero join the
    /// free queue in that order, split as vLLM 0.33 does: blocks registered in the prefix cache
    /// go to the tail (evicted last, so they can still be hit); blocks without a hash (partial,
    /// lookahead or uncached blocks) go to the head, to be reused first.
    pub fn free_blocks(&mut self, blocks: impl IntoIterator<Item = u32>) {
        let mut reuse_first = std::mem::take(&mut self.scratch);
        reuse_first.clear();
        for b in blocks {
            if b == NULL_BLOCK {
                continue;
            }
            let rc = &mut self.meta[b as usize].ref_cnt;
            if *rc == 0 {
                // A double free (a bug in the caller): ignoring it keeps the free queue sound.
                debug_assert!(false, "double free of block {b}");
                continue;
            }
            *rc -= 1;
            if *rc == 0 {
                if self.prefix.is_registered(&self.meta, b) {
                    self.free.push_back(b);
                } else {
                    reuse_first.push(b);
                }
            }
        }
        for &b in reuse_first.iter().rev() {
            self.free.push_front(b);
        }
        self.scratch = reuse_first;
    }

    /// Registers `blocks[i]` under `hashes[i]` for every pair. A block already registered
    /// (under the same hash: it holds the same tokens) is left as it is. Returns the
    /// fingerprint of the prefix ending with the last block (None when hits are not verified),
    /// for the caller to pass as the next call's `parent_fingerprint`.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[u32],
        hashes: &[BlockHash],
        src: BlockSource<'_>,
    ) -> Option<Fingerprint> {
        if !self.enable_caching {
            return None;
        }
        debug_assert_eq!(blocks.len(), hashes.len());
        let mut fingerprint = self.fingerprint_before(src);
        for (i, (&b, h)) in blocks.iter().zip(hashes).enumerate() {
            let tokens = self.provenance.as_ref().map(|prov| {
                let bs = prov.block_size();
                &src.tokens[(src.first + i) * bs..(src.first + i + 1) * bs]
            });
            if let (Some(prov), Some(tokens)) = (&self.provenance, tokens) {
                fingerprint = Some(prov.chain(fingerprint, tokens, src.extra, src.first + i));
            }
            if b == NULL_BLOCK {
                continue;
            }
            if let Some(existing) = self.prefix.hash_of(&self.meta, b) {
                debug_assert_eq!(existing, h, "block {b} is re-cached under another hash");
                continue;
            }
            if let (Some(prov), Some(tokens)) = (&mut self.provenance, tokens) {
                prov.record(b, tokens);
            }
            self.prefix
                .insert(&mut self.meta, *h, b, fingerprint.unwrap_or(0));
        }
        fingerprint
    }

    /// Prefetches what [`Self::cache_full_blocks`] touches for each pair: the block's prefix
    /// entry and bucket, and its token copy.
    pub fn prefetch_cache_lines(&self, blocks: &[u32], hashes: &[BlockHash]) {
        if !self.enable_caching {
            return;
        }
        for (&b, h) in blocks.iter().zip(hashes) {
            self.prefix.prefetch_bucket(h);
            if let Some(m) = self.meta.get(b as usize) {
                crate::memory::prefetch::read(m);
            }
            if let Some(prov) = &self.provenance {
                prov.prefetch(b);
            }
        }
    }

    /// Second wave after [`Self::prefetch_cache_lines`]: prefetches the records the new
    /// registrations link after (their buckets' last blocks), reading the buckets.
    pub fn prefetch_cache_chains(&self, hashes: &[BlockHash]) {
        if self.enable_caching {
            for h in hashes {
                self.prefix.prefetch_chain_tail(&self.meta, h);
            }
        }
    }

    /// The fingerprint of the prefix before `src`'s first block: the caller's, else the
    /// parent's entry when the parent is cached, else recomputed from the request's tokens.
    fn fingerprint_before(&self, src: BlockSource<'_>) -> Option<Fingerprint> {
        let prov = self.provenance.as_ref()?;
        if src.first == 0 {
            return None;
        }
        if src.parent_fingerprint.is_some() {
            return src.parent_fingerprint;
        }
        if src.parent != NULL_BLOCK {
            if let Some(fp) = self.prefix.fingerprint_of(&self.meta, src.parent) {
                return Some(fp);
            }
        }
        let bs = prov.block_size();
        src.tokens[..src.first * bs]
            .chunks_exact(bs)
            .enumerate()
            .fold(None, |fp, (i, block)| {
                Some(prov.chain(fp, block, src.extra, i))
            })
    }

    /// Evicts `block`'s hash from the prefix cache if it is registered; returns whether it was.
    pub fn evict_hash(&mut self, block: u32) -> bool {
        let evicted = self.prefix.remove(&mut self.meta, block).is_some();
        if let (true, Some(log)) = (evicted, self.events.as_deref_mut()) {
            log.removed(block);
        }
        evicted
    }

    /// Empties the prefix cache. Fails (returns false, changes nothing) while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() != self.num_usable_blocks() {
            return false;
        }
        self.prefix.clear(&mut self.meta);
        if let Some(log) = self.events.as_deref_mut() {
            log.cleared();
        }
        true
    }

    /// Checks the pool's own invariants; `holders[b]` is how many requests list block `b`
    /// (pass `None` to skip the ref-count cross-check).
    pub fn check_invariants(&self, holders: Option<&[u32]>) -> CoreResult<()> {
        let n = self.num_blocks();
        if self.meta[NULL_BLOCK as usize].ref_cnt != 0 || self.free.contains(NULL_BLOCK) {
            return Err(broken!("null block is referenced or free"));
        }
        if self.prefix.is_registered(&self.meta, NULL_BLOCK) {
            return Err(broken!("null block is hashed"));
        }
        let mut seen = vec![false; n];
        let mut count = 0;
        for b in self.free.iter() {
            if seen[b as usize] {
                return Err(broken!("block {b} appears twice in the free queue"));
            }
            seen[b as usize] = true;
            count += 1;
        }
        if count != self.free.len() {
            return Err(broken!(
                "free queue length {} != linked blocks {count}",
                self.free.len()
            ));
        }
        let mut used = 0;
        for b in 1..n {
            let rc = self.meta[b].ref_cnt;
            if seen[b] == (rc > 0) {
                return Err(broken!(
                    "block {b}: ref count {rc} but in free queue = {}",
                    seen[b]
                ));
            }
            if rc > 0 {
                used += 1;
            }
            if let Some(holders) = holders {
                if holders[b] != rc {
                    return Err(broken!(
                        "block {b}: ref count {rc} != holders {}",
                        holders[b]
                    ));
                }
            }
        }
        if used + self.free.len() != self.num_usable_blocks() {
            return Err(broken!(
                "used {used} + free {} != usable {}",
                self.free.len(),
                self.num_usable_blocks()
            ));
        }
        self.prefix.check(&self.meta)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Provenance of blocks in a pool without hit verification (tokens unused).
    fn source(tokens: &[u32]) -> BlockSource<'_> {
        static NO_EXTRA: ExtraKeys = ExtraKeys {
            lora_name: None,
            cache_salt: None,
            prompt_embed_hashes: Vec::new(),
        };
        BlockSource {
            tokens,
            first: 0,
            parent: NULL_BLOCK,
            extra: &NO_EXTRA,
            parent_fingerprint: None,
        }
    }

    #[test]
    fn null_block_is_never_handed_out() {
        let mut pool = BlockPool::new(4, true).unwrap();
        assert_eq!(pool.num_usable_blocks(), 3);
        let mut out = Vec::new();
        pool.get_new_blocks(3, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3]);
        assert!(pool.get_new_blocks(1, &mut out).is_err());
        assert_eq!(out.len(), 3, "a failed get leaves the output untouched");
        pool.check_invariants(None).unwrap();
    }

    #[test]
    fn freed_hashed_block_is_reused_through_touch() {
        let mut pool = BlockPool::new(4, true).unwrap();
        let mut out = Vec::new();
        pool.get_new_blocks(2, &mut out).unwrap();
        pool.cache_full_blocks(&out[..1], &[[7; 32]], source(&[]));
        pool.free_blocks(out.iter().rev().copied());
        // Unhashed block 2 is reused first; cached block 1 is evicted last.
        assert_eq!(pool.free_block_ids(), [2, 3, 1]);
        assert_eq!(pool.get_cached_block(&[7; 32]), Some(1));
        pool.touch(&[1]);
        assert_eq!(pool.free_block_ids(), [2, 3]);
        assert_eq!(pool.ref_count(1), 1);
        pool.check_invariants(None).unwrap();
        assert!(!pool.reset_prefix_cache());
        pool.free_blocks([1]);
        assert!(pool.reset_prefix_cache());
        assert_eq!(pool.get_cached_block(&[7; 32]), None);
        pool.check_invariants(None).unwrap();
    }

    #[test]
    fn reuse_evicts_the_hash() {
        let mut pool = BlockPool::new(2, true).unwrap();
        let mut out = Vec::new();
        pool.get_new_blocks(1, &mut out).unwrap();
        pool.cache_full_blocks(&out, &[[1; 32]], source(&[]));
        pool.free_blocks(out.clone());
        out.clear();
        pool.get_new_blocks(1, &mut out).unwrap();
        assert_eq!(pool.block_hash(1), None);
        assert_eq!(pool.get_cached_block(&[1; 32]), None);
    }
}
