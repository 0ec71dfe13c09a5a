//! KV-cache manager: per-request block lists on top of the block pool, prefix-cache lookups and
//! all-or-nothing, lookahead-aware slot allocation (vLLM 0.33 semantics, one full-attention group).
//!
//! The manager does not own request state: callers keep a [`RequestBlocks`] per request and pass
//! it in together with a [`SequenceView`] of the request's tokens, so the scheduler needs no map
//! lookups on the hot path.

use crate::error::{invalid, CoreError, CoreResult};
use crate::pool::block_pool::{BlockPool, BlockSource, NULL_BLOCK};
use crate::pool::kv_events::KvEvent;
use crate::requests::kv_view::{RequestBlocks, SequenceView};

/// Arguments of one `allocate_slots` call.
#[derive(Debug, Clone, Copy, Default)]
pub struct AllocateArgs<'a> {
    /// Tokens the target model computes this step (prompt chunk, or 1 + drafts). Must be > 0.
    pub num_new_tokens: usize,
    /// Tokens whose KV is already in the request's blocks.
    pub num_computed_tokens: usize,
    /// Prefix-cache hit length in tokens (from `get_computed_blocks`), only for a request
    /// holding no blocks yet.
    pub num_new_computed_tokens: usize,
    /// The hit blocks to adopt.
    pub new_computed_blocks: &'a [u32],
    /// Extra slots after the scheduled tokens for the drafter; never cached.
    pub num_lookahead_tokens: usize,
    /// Admission gate: fail unless the whole known sequence fits (lookahead not included).
    pub full_sequence_must_fit: bool,
}

/// Prefix-cache lookup counters, in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Lookups made.
    pub requests: u64,
    /// Tokens looked up.
    pub queries: u64,
    /// Tokens found.
    pub hits: u64,
}

/// Block lists, prefix cache and allocation for one full-attention KV-cache group.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    pool: BlockPool,
    block_size: usize,
    max_model_len: usize,
    stats: PrefixCacheStats,
    /// Give back the last block of every prefix-cache hit (vLLM's EAGLE block drop).
    drop_last_hit_block: bool,
    /// Tokens after each block that its hash covers: a sequence's hashes lag its full blocks
    /// by this many tokens.
    hash_lookahead_tokens: usize,
}

/// Rejects an allocation of no tokens.
fn check_new_tokens(num_new_tokens: usize) -> CoreResult<()> {
    if num_new_tokens == 0 {
        return Err(invalid!("num_new_tokens must be positive"));
    }
    Ok(())
}

/// `ceil(a / b)`.
pub fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl KvCacheManager {
    /// A manager over `num_blocks` blocks of `block_size` tokens; refuses a pool beyond the
    /// bounds of `limits::check_pool` before allocating it.
    pub fn new(
        num_blocks: usize,
        block_size: usize,
        max_model_len: usize,
        enable_caching: bool,
    ) -> CoreResult<Self> {
        if block_size == 0 {
            return Err(invalid!("block_size must be positive"));
        }
        if max_model_len == 0 {
            return Err(invalid!("max_model_len must be positive"));
        }
        crate::limits::check_pool(num_blocks, block_size, max_model_len, enable_caching)?;
        let mut pool = BlockPool::new(num_blocks, enable_caching)?;
        pool.set_verify_hits(Some(block_size))?;
        Ok(Self {
            pool,
            block_size,
            max_model_len,
            stats: PrefixCacheStats::default(),
            drop_last_hit_block: false,
            hash_lookahead_tokens: 0,
        })
    }

    /// Drops the last block of every prefix-cache hit, so that its tokens are recomputed (vLLM's
    /// default for drafters that read the target's hidden states: EAGLE, EAGLE3, MTP, and DFlash
    /// in vLLM 0.32). Off by default.
    pub fn set_drop_last_hit_block(&mut self, on: bool) {
        self.drop_last_hit_block = on;
    }

    /// Declares that block hashes cover `tokens` tokens after their block (see
    /// [`crate::BlockHasher::with_lookahead`]): a full block whose next tokens do not exist yet
    /// has no hash, and is cached once they do. 0 by default.
    pub fn set_hash_lookahead_tokens(&mut self, tokens: usize) {
        self.hash_lookahead_tokens = tokens;
    }

    /// Turns verification of prefix-cache hits (on by default) on or off; only while nothing is
    /// cached. Off trusts a hit on its hash alone, as vLLM does: a test switch that shows what
    /// verification guards against under a forced hash collision.
    pub fn set_verify_hits(&mut self, on: bool) -> CoreResult<()> {
        self.pool.set_verify_hits(on.then_some(self.block_size))
    }

    /// Turns the KV-cache event log on (empty) or off.
    pub fn set_kv_events(&mut self, on: bool) {
        self.pool.set_kv_events(on);
    }

    /// Takes the KV-cache events recorded so far (none while events are off).
    pub fn take_kv_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_kv_events()
    }

    /// Whether the KV-cache event log is on (callers check it before naming a request, so
    /// that without events they read nothing of it).
    #[inline]
    pub fn kv_events_on(&self) -> bool {
        self.pool.kv_events_on()
    }

    /// Names `request_id` as the request whose blocks the `Stored` events recorded since the
    /// last call registered: the caller names the request after each call that may register
    /// blocks of it (allocation, [`Self::cache_blocks`]).
    pub fn attribute_kv_events(&mut self, request_id: &str) {
        if let Some(log) = self.pool.kv_events_mut() {
            log.attribute(request_id);
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Longest sequence a request may reach.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    /// The underlying pool (read-only).
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Free (or evictable) blocks.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    /// Fraction of usable blocks in use.
    pub fn usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Prefix-cache lookup counters.
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// Empties the prefix cache; false (and no change) while any block is held.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Puts the lookup counters back (a refused `schedule()` undoes its lookups).
    pub(crate) fn set_prefix_cache_stats(&mut self, stats: PrefixCacheStats) {
        self.stats = stats;
    }

    /// Longest cached prefix of `seq`, capped at `num_tokens - 1` and block aligned: fills `hits`
    /// with the cached blocks and returns the hit length in tokens. Touches nothing.
    pub fn get_computed_blocks(&mut self, seq: SequenceView<'_>, hits: &mut Vec<u32>) -> usize {
        hits.clear();
        let num_tokens = seq.num_tokens();
        if !self.pool.caching_enabled() || num_tokens == 0 {
            return 0;
        }
        let bs = self.block_size;
        let max_hit_blocks = ((num_tokens - 1) / bs).min(seq.block_hashes.len());
        let mut fingerprint = None;
        for (i, hash) in seq.block_hashes[..max_hit_blocks].iter().enumerate() {
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            fingerprint = self
                .pool
                .prefix_fingerprint(fingerprint, tokens, seq.extra, i);
            match self.pool.find_cached_block(hash, tokens, fingerprint) {
                Some(b) => hits.push(b),
                None => break,
            }
        }
        if self.drop_last_hit_block {
            hits.pop();
        }
        let hit_tokens = hits.len() * self.block_size;
        self.stats.requests += 1;
        self.stats.queries += num_tokens as u64;
        self.stats.hits += hit_tokens as u64;
        hit_tokens
    }

    /// Blocks the pool must give up for a request to own `num_slot_tokens` slots.
    fn blocks_to_allocate(
        &self,
        req: &RequestBlocks,
        hits: &[u32],
        num_slot_tokens: usize,
    ) -> usize {
        let required = cdiv(num_slot_tokens, self.block_size);
        if !req.block_ids.is_empty() {
            return required.saturating_sub(req.block_ids.len());
        }
        let evictable_hits = hits
            .iter()
            .filter(|&&b| self.pool.ref_count(b) == 0)
            .count();
        required.saturating_sub(hits.len()) + evictable_hits
    }

    /// Rejects arguments that no correct caller passes; changes nothing.
    fn validate(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
        args: &AllocateArgs<'_>,
        check_hits: bool,
    ) -> CoreResult<()> {
        let bs = self.block_size;
        check_new_tokens(args.num_new_tokens)?;
        let hits = args.new_computed_blocks;
        if args.num_new_computed_tokens != hits.len() * bs {
            return Err(invalid!(
                "num_new_computed_tokens ({}) must equal len(new_computed_blocks) * block_size ({})",
                args.num_new_computed_tokens,
                hits.len() * bs
            ));
        }
        if !hits.is_empty() && (!req.block_ids.is_empty() || args.num_computed_tokens != 0) {
            return Err(invalid!(
                "prefix-cache hits can only be adopted by a request that holds no blocks and has \
                 no computed tokens"
            ));
        }
        self.check_owned(req, args.num_computed_tokens)?;
        let end = self.checked_end(
            args.num_computed_tokens,
            args.num_new_computed_tokens,
            args.num_new_tokens,
            args.num_lookahead_tokens,
        )?;
        if args.num_new_computed_tokens > seq.num_tokens().saturating_sub(1) {
            return Err(invalid!(
                "a prefix hit of {} tokens is not below the sequence's {} tokens",
                args.num_new_computed_tokens,
                seq.num_tokens()
            ));
        }
        let mut fingerprint = None;
        for (i, &b) in hits.iter().enumerate().take_while(|_| check_hits) {
            // Hits lie below num_tokens - 1 (checked above), so the block's tokens exist.
            let tokens = &seq.tokens[i * bs..(i + 1) * bs];
            fingerprint = self
                .pool
                .prefix_fingerprint(fingerprint, tokens, seq.extra, i);
            let is_prefix = (b as usize) < self.pool.num_blocks()
                && seq.block_hashes.get(i).is_some_and(|h| {
                    self.pool.block_hash(b) == Some(h)
                        && self.pool.hit_matches(b, tokens, fingerprint)
                });
            if !is_prefix {
                return Err(invalid!(
                    "new_computed_blocks[{i}] = {b} is not the cached block of this request's \
                     prefix block {i}"
                ));
            }
        }
        self.check_hashes(seq, end)
    }

    /// Rejects `num_computed_tokens` beyond the slots `req` owns.
    fn check_owned(&self, req: &RequestBlocks, num_computed_tokens: usize) -> CoreResult<()> {
        let owned = req.block_ids.len() * self.block_size;
        if num_computed_tokens > owned {
            return Err(invalid!(
                "num_computed_tokens ({num_computed_tokens}) exceeds the {owned} slots the request owns"
            ));
        }
        Ok(())
    }

    /// The end of the tokens computed after the step (`computed + hits + new`), refused on
    /// overflow (lookahead included) or past `max_model_len`.
    fn checked_end(
        &self,
        num_computed_tokens: usize,
        num_new_computed_tokens: usize,
        num_new_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> CoreResult<usize> {
        let end = num_computed_tokens
            .checked_add(num_new_computed_tokens)
            .and_then(|x| x.checked_add(num_new_tokens))
            .and_then(|x| x.checked_add(num_lookahead_tokens).map(|_| x))
            .ok_or_else(|| invalid!("token counts overflow"))?;
        if end > self.max_model_len {
            return Err(CoreError::TooLong(format!(
                "num_computed_tokens + num_new_computed_tokens + num_new_tokens = {end} exceeds \
                 max_model_len {}",
                self.max_model_len
            )));
        }
        Ok(end)
    }

    /// Rejects a sequence without the hashes of the full blocks below `end` that allocation
    /// registers.
    fn check_hashes(&self, seq: SequenceView<'_>, end: usize) -> CoreResult<()> {
        if self.pool.caching_enabled() {
            let bs = self.block_size;
            let known = end.min(seq.num_tokens());
            if known < seq.block_hashes.len().saturating_add(1).saturating_mul(bs) {
                // No more full blocks than hashes (the usual case), found without a division.
                return Ok(());
            }
            let hashable = seq.num_tokens().saturating_sub(self.hash_lookahead_tokens) / bs;
            let to_cache = (known / bs).min(hashable);
            if to_cache > seq.block_hashes.len() {
                return Err(invalid!(
                    "sequence has {} block hashes but {to_cache} full blocks to cache",
                    seq.block_hashes.len()
                ));
            }
        }
        Ok(())
    }

    /// Gives `req` slots for every position below
    /// `min(computed + hits + new + lookahead, max_model_len)`, adopting the hit blocks first.
    ///
    /// Returns `Ok(Some(i))` where `req.block_ids[i..]` are the newly allocated blocks, or
    /// `Ok(None)` if the pool cannot serve it, in which case nothing changed. Registers every
    /// newly full block of known tokens in the prefix cache (never drafts or lookahead slots).
    pub fn allocate_slots(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        args: AllocateArgs<'_>,
    ) -> CoreResult<Option<usize>> {
        self.allocate(req, seq, args, true)
    }

    /// [`Self::allocate_slots`] without prefix-cache hits or admission gate (a running
    /// request's next tokens): the same checks, errors and result, in fewer steps.
    pub(crate) fn extend_slots(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        num_new_tokens: usize,
        num_computed_tokens: usize,
        num_lookahead_tokens: usize,
    ) -> CoreResult<Option<usize>> {
        crate::fault::hit("allocate_slots.begin")?;
        // `validate`'s checks that apply without hits, in its order.
        check_new_tokens(num_new_tokens)?;
        self.check_owned(req, num_computed_tokens)?;
        let end = self.checked_end(num_computed_tokens, 0, num_new_tokens, num_lookahead_tokens)?;
        self.check_hashes(seq, end)?;
        // `allocate` without hits: every block past those held is new.
        let need_slot = (end + num_lookahead_tokens).min(self.max_model_len);
        let first_new = req.block_ids.len();
        if need_slot > first_new.saturating_mul(self.block_size) {
            // Past the slots held (most decode steps are not): new blocks.
            let num_new_blocks = cdiv(need_slot, self.block_size) - first_new;
            if num_new_blocks > self.pool.num_free_blocks() {
                return Ok(None);
            }
            self.pool
                .get_new_blocks(num_new_blocks, &mut req.block_ids)?;
        }
        self.cache_blocks(req, seq, end);
        Ok(Some(first_new))
    }

    /// [`Self::allocate_slots`] for hits that [`Self::get_computed_blocks`] has just returned
    /// for this very sequence, with no change to the pool since: the per-block check of the
    /// hits (hash, tokens and prefix fingerprint), which that lookup made, is not repeated.
    pub(crate) fn allocate_slots_after_lookup(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        args: AllocateArgs<'_>,
    ) -> CoreResult<Option<usize>> {
        self.allocate(req, seq, args, false)
    }

    fn allocate(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        args: AllocateArgs<'_>,
        check_hits: bool,
    ) -> CoreResult<Option<usize>> {
        crate::fault::hit("allocate_slots.begin")?;
        self.validate(req, seq, &args, check_hits)?;
        let hits = args.new_computed_blocks;
        let total =
            (args.num_computed_tokens + args.num_new_computed_tokens).min(self.max_model_len);
        let main = total + args.num_new_tokens;
        let need_slot = (main + args.num_lookahead_tokens).min(self.max_model_len);
        let free = self.pool.num_free_blocks();

        if args.full_sequence_must_fit {
            let full_len = seq.num_tokens().min(self.max_model_len);
            if self.blocks_to_allocate(req, hits, full_len) > free {
                return Ok(None);
            }
        }
        if self.blocks_to_allocate(req, hits, need_slot) > free {
            return Ok(None);
        }

        if !hits.is_empty() {
            self.pool.touch(hits);
            req.block_ids.extend_from_slice(hits);
            req.num_cached_blocks = hits.len();
            req.set_cached_fingerprint(None);
        }
        let first_new = req.block_ids.len();
        let num_new_blocks = cdiv(need_slot, self.block_size).saturating_sub(first_new);
        if num_new_blocks > 0 {
            // Most decode steps fit in the blocks a request holds.
            self.pool
                .get_new_blocks(num_new_blocks, &mut req.block_ids)?;
        }

        self.cache_blocks(req, seq, main);
        Ok(Some(first_new))
    }

    /// The blocks [`Self::cache_blocks`] would register for the same arguments (indices into
    /// `req.block_ids`).
    fn blocks_to_cache(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
        num_tokens: usize,
    ) -> std::ops::Range<usize> {
        let num_full = (num_tokens.min(seq.num_tokens()) / self.block_size)
            .min(req.block_ids.len())
            .min(seq.block_hashes.len());
        req.num_cached_blocks.min(num_full)..num_full
    }

    /// Whether the block after those `req` registered is short of full below `num_tokens`
    /// known tokens, so [`Self::blocks_to_cache`] is empty (most decode steps): found without
    /// a division.
    #[inline]
    fn next_block_unfilled(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
        num_tokens: usize,
    ) -> bool {
        let known = num_tokens.min(seq.num_tokens());
        let next_block = req.num_cached_blocks.saturating_add(1);
        known < next_block.saturating_mul(self.block_size)
    }

    /// Whether [`Self::cache_blocks`] has anything to register for these arguments; if so,
    /// prefetches the pool lines it will touch, so a later call finds them in cache, and
    /// appends the hashes of those blocks to `hashes` for the second wave
    /// ([`Self::prefetch_chains`]).
    #[inline]
    pub(crate) fn prefetch_cache_blocks_noting(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
        num_tokens: usize,
        hashes: &mut Vec<crate::hashing::BlockHash>,
    ) -> bool {
        if !self.pool.caching_enabled() {
            return false;
        }
        let range = self.blocks_to_cache(req, seq, num_tokens);
        // Most calls (a decode step that fills no block) have nothing to prefetch: no call then.
        if range.is_empty() {
            return false;
        }
        self.prefetch_range(req, seq, range, hashes);
        true
    }

    /// Whether a running request's next allocation registers blocks (those full of its known
    /// tokens), found without a division: most decode steps complete none. If it does, the
    /// lines of its first such block's id and hash are prefetched, which
    /// [`Self::prefetch_cache_blocks_noting`] reads next.
    #[inline]
    pub(crate) fn registers_on_next_allocation(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
    ) -> bool {
        let num_tokens = seq.num_tokens();
        if !self.pool.caching_enabled() || self.next_block_unfilled(req, seq, num_tokens) {
            return false;
        }
        let range = self.blocks_to_cache(req, seq, num_tokens);
        if let (Some(id), Some(hash)) = (
            req.block_ids.get(range.start),
            seq.block_hashes.get(range.start),
        ) {
            crate::memory::prefetch::read(id);
            crate::memory::prefetch::read(hash);
        }
        !range.is_empty()
    }

    /// [`Self::prefetch_cache_blocks_noting`] of a non-empty `range` of blocks.
    fn prefetch_range(
        &self,
        req: &RequestBlocks,
        seq: SequenceView<'_>,
        range: std::ops::Range<usize>,
        hashes: &mut Vec<crate::hashing::BlockHash>,
    ) {
        let block_hashes = &seq.block_hashes[range.clone()];
        self.pool
            .prefetch_cache_lines(&req.block_ids[range], block_hashes);
        hashes.extend_from_slice(block_hashes);
    }

    /// The second wave after [`Self::prefetch_cache_blocks_noting`], given the hashes it
    /// noted: the records the registrations will link after (reading their buckets, which the
    /// first wave prefetched).
    pub(crate) fn prefetch_chains(&self, hashes: &[crate::hashing::BlockHash]) {
        if self.pool.caching_enabled() {
            self.pool.prefetch_cache_chains(hashes);
        }
    }

    /// Registers in the prefix cache every block of `req` that is full of known tokens below
    /// `num_tokens` (whose KV is, or is being, computed) and not registered yet. Never drafts or
    /// lookahead slots.
    #[inline]
    pub fn cache_blocks(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        num_tokens: usize,
    ) {
        if !self.pool.caching_enabled() || self.next_block_unfilled(req, seq, num_tokens) {
            return;
        }
        let range = self.blocks_to_cache(req, seq, num_tokens);
        // Most calls (a decode step that fills no block) register nothing: no call then.
        if !range.is_empty() {
            self.cache_range(req, seq, range);
        }
    }

    /// [`Self::cache_blocks`] of the non-empty `range` of blocks that `blocks_to_cache` gave.
    fn cache_range(
        &mut self,
        req: &mut RequestBlocks,
        seq: SequenceView<'_>,
        range: std::ops::Range<usize>,
    ) {
        let num_full = range.end;
        if range.len() > 1 {
            // A prefill chunk's blocks: their misses overlap when all are asked for first.
            self.pool.prefetch_cache_lines(
                &req.block_ids[range.clone()],
                &seq.block_hashes[range.clone()],
            );
            self.pool
                .prefetch_cache_chains(&seq.block_hashes[range.clone()]);
        }
        let src = BlockSource {
            tokens: seq.tokens,
            first: range.start,
            parent: range
                .start
                .checked_sub(1)
                .map_or(NULL_BLOCK, |p| req.block_ids[p]),
            extra: seq.extra,
            parent_fingerprint: req.cached_fingerprint(),
        };
        if self.pool.kv_events_on() {
            let bs = self.block_size;
            self.pool.record_stored(
                src.first,
                src.parent,
                &req.block_ids[range.clone()],
                // The hashed blocks' next tokens exist: a block is hashed only once they do.
                &seq.tokens[range.start * bs..range.end * bs + self.hash_lookahead_tokens],
                bs,
                self.hash_lookahead_tokens,
            );
        }
        let fingerprint = self.pool.cache_full_blocks(
            &req.block_ids[range.clone()],
            &seq.block_hashes[range],
            src,
        );
        req.set_cached_fingerprint(fingerprint);
        req.num_cached_blocks = num_full;
    }

    /// Withdraws from the prefix cache the blocks `req` registered from index `from` on, when
    /// their KV will never be computed (a step undone before it ran). Blocks another request
    /// also holds keep their entry.
    pub fn uncache_blocks(&mut self, req: &mut RequestBlocks, from: usize) {
        let end = req.num_cached_blocks.min(req.block_ids.len());
        for &b in req.block_ids.get(from..end).unwrap_or(&[]) {
            if self.pool.ref_count(b) == 1 {
                self.pool.evict_hash(b);
            }
        }
        if from < req.num_cached_blocks {
            req.num_cached_blocks = from;
            req.set_cached_fingerprint(None);
        }
    }

    /// Releases every block of `req`, tail first, and clears it.
    pub fn free(&mut self, req: &mut RequestBlocks) {
        self.pool.free_blocks(req.block_ids.iter().rev().copied());
        req.block_ids.clear();
        req.num_cached_blocks = 0;
        req.set_cached_fingerprint(None);
    }

    /// Checks the pool against the block lists of every live request.
    pub fn check_invariants<'a>(
        &self,
        requests: impl IntoIterator<Item = &'a RequestBlocks>,
    ) -> CoreResult<()> {
        let mut holders = vec![0u32; self.pool.num_blocks()];
        for req in requests {
            for &b in &req.block_ids {
                if b == 0 || b as usize >= holders.len() {
                    return Err(crate::error::broken!("a request lists invalid block {b}"));
                }
                holders[b as usize] += 1;
            }
            for (i, &b) in req.block_ids.iter().enumerate().take(req.num_cached_blocks) {
                if self.pool.caching_enabled() && self.pool.block_hash(b).is_none() {
                    return Err(crate::error::broken!(
                        "block {b} at index {i} is counted as cached but has no hash"
                    ));
                }
            }
        }
        if holders
            .iter()
            .enumerate()
            .any(|(b, &n)| n > 1 && self.pool.block_hash(b as u32).is_none())
        {
            return Err(crate::error::broken!(
                "an unhashed block is shared by several requests"
            ));
        }
        self.pool.check_invariants(Some(&holders))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{BlockHash, ExtraKeys};

    /// The block lists the tests below try, with how many of the sequence's block hashes
    /// exist: every count of registered blocks that each pair allows.
    fn request_shapes() -> Vec<(RequestBlocks, usize)> {
        let mut shapes = Vec::new();
        for num_hashes in [0, 3, 10] {
            for num_blocks in [0, 2, 10] {
                for num_cached in 0..=num_blocks.min(num_hashes) {
                    let req = RequestBlocks {
                        block_ids: vec![1; num_blocks],
                        num_cached_blocks: num_cached,
                        cached_fingerprint: None,
                    };
                    shapes.push((req, num_hashes));
                }
            }
        }
        shapes
    }

    /// The running phase's prefetch pass picks exactly the requests whose next allocation
    /// registers blocks (those `cache_blocks` registers up to the known tokens), and none when
    /// caching is off.
    #[test]
    fn a_request_registers_on_next_allocation_exactly_when_it_has_blocks_to_cache() {
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = vec![[0u8; 32] as BlockHash; 10];
        let extra = ExtraKeys::default();
        let (mut registering, mut not) = (0, 0);
        for caching in [true, false] {
            let kv = KvCacheManager::new(64, 4, 256, caching).unwrap();
            for (req, num_hashes) in request_shapes() {
                for num_tokens in 0..=tokens.len() {
                    let seq = SequenceView {
                        tokens: &tokens[..num_tokens],
                        block_hashes: &hashes[..num_hashes],
                        extra: &extra,
                    };
                    let expected = caching && !kv.blocks_to_cache(&req, seq, num_tokens).is_empty();
                    let got = kv.registers_on_next_allocation(&req, seq);
                    assert_eq!(
                        got, expected,
                        "{req:?}, {num_hashes} hashes, {num_tokens} tokens, caching {caching}"
                    );
                    if got {
                        registering += 1;
                    } else {
                        not += 1;
                    }
                }
            }
        }
        assert!(registering > 0 && not > 0);
    }

    /// `next_block_unfilled` answers without a division only where `blocks_to_cache` is empty.
    #[test]
    fn an_unfilled_next_block_has_nothing_to_cache() {
        let kv = KvCacheManager::new(64, 4, 256, true).unwrap();
        let tokens: Vec<u32> = (0..40).collect();
        let hashes = vec![[0u8; 32] as BlockHash; 10];
        let extra = ExtraKeys::default();
        for (req, num_hashes) in request_shapes() {
            let seq = SequenceView {
                tokens: &tokens,
                block_hashes: &hashes[..num_hashes],
                extra: &extra,
            };
            for num_tokens in 0..48 {
                if kv.next_block_unfilled(&req, seq, num_tokens) {
                    assert!(kv.blocks_to_cache(&req, seq, num_tokens).is_empty());
                }
            }
        }
    }

    /// `extend_slots` is `allocate_slots` without hits or admission gate, written apart for
    /// the running phase: the same result, error and state after, on every combination of
    /// held blocks, known tokens, hashes, computed and new tokens, lookahead and pool size.
    #[test]
    fn extend_slots_agrees_with_allocate_slots_without_hits() {
        let bs: usize = 4;
        let extra = ExtraKeys::default();
        let tokens: Vec<u32> = (0..24).collect();
        let hashes: Vec<BlockHash> = (0..6u8).map(|i| [i + 1; 32]).collect();
        let outcome = |r: &CoreResult<Option<usize>>| match r {
            Ok(v) => format!("{v:?}"),
            Err(e) => format!("error: {e}"),
        };
        let mut cases = 0;
        for pool in [3, 40] {
            for held in 0..=4usize {
                for num_tokens in [1usize, 5, 8, 13, 16, 20] {
                    let full = num_tokens / bs;
                    for num_hashes in [full, full.saturating_sub(1)] {
                        let owned = held * bs;
                        for computed in [0, owned.saturating_sub(1), owned, owned + 1] {
                            for new in [0, 1, 3, 9] {
                                for lookahead in [0, 4] {
                                    let mut kv = KvCacheManager::new(pool, bs, 24, true).unwrap();
                                    let mut req = RequestBlocks::default();
                                    if kv.pool.get_new_blocks(held, &mut req.block_ids).is_err() {
                                        continue;
                                    }
                                    let seq = SequenceView {
                                        tokens: &tokens[..num_tokens],
                                        block_hashes: &hashes[..num_hashes],
                                        extra: &extra,
                                    };
                                    let (mut kv2, mut req2) = (kv.clone(), req.clone());
                                    let args = AllocateArgs {
                                        num_new_tokens: new,
                                        num_computed_tokens: computed,
                                        num_lookahead_tokens: lookahead,
                                        ..Default::default()
                                    };
                                    let a = kv.allocate_slots(&mut req, seq, args);
                                    let b =
                                        kv2.extend_slots(&mut req2, seq, new, computed, lookahead);
                                    let case = (pool, held, num_tokens, num_hashes, computed);
                                    assert_eq!(
                                        outcome(&a),
                                        outcome(&b),
                                        "{case:?} {new} {lookahead}"
                                    );
                                    assert_eq!(req, req2, "{case:?} {new} {lookahead}");
                                    assert_eq!(format!("{kv:?}"), format!("{kv2:?}"));
                                    cases += 1;
                                }
                            }
                        }
                    }
                }
            }
        }
        assert!(cases > 3000, "{cases}");
    }
}
