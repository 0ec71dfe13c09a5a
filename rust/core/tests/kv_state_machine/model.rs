//! The reference model of vLLM V1's rules for one group, and the requests as the test driver
//! keeps them.

use super::*;

/// What identifies a block's content: the model's prefix-cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ContentKey {
    pub(crate) lora: Option<u8>,
    pub(crate) salt: Option<u8>,
    pub(crate) tokens: Vec<u32>,
}

#[derive(Debug)]
pub(crate) struct Content {
    pub(crate) lora: Option<u8>,
    pub(crate) salt: Option<u8>,
    /// `lora` and `salt` as the hasher sees them.
    pub(crate) extra: ExtraKeys,
    pub(crate) tokens: Vec<u32>,
    /// Real chained hashes of the full blocks (empty with caching off, as the bindings do).
    pub(crate) hashes: Vec<BlockHash>,
}

impl Content {
    pub(crate) fn key(&self, block: usize, block_size: usize) -> ContentKey {
        ContentKey {
            lora: self.lora,
            salt: self.salt,
            tokens: self.tokens[..(block + 1) * block_size].to_vec(),
        }
    }

    pub(crate) fn extra_keys(&self) -> ExtraKeys {
        self.extra.clone()
    }

    pub(crate) fn view(&self) -> SequenceView<'_> {
        SequenceView {
            tokens: &self.tokens,
            block_hashes: &self.hashes,
            extra: &self.extra,
        }
    }
}

/// The model's per-request state.
#[derive(Debug, Default)]
pub(crate) struct ModelRequest {
    pub(crate) blocks: Vec<u32>,
    pub(crate) num_cached: usize,
}

#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) content: Content,
    pub(crate) num_computed_tokens: usize,
    /// `num_cached_blocks` before the last successful allocation (what undoing it restores).
    pub(crate) cached_before_last_step: usize,
    pub(crate) real: RequestBlocks,
    pub(crate) model: ModelRequest,
}

// The reference model

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    TooLong,
    NoRoom,
    Allocated { first_new: usize },
}

/// vLLM V1's block pool + single full-attention manager, with plain containers.
pub(crate) struct Model {
    pub(crate) block_size: usize,
    pub(crate) max_model_len: usize,
    pub(crate) caching: bool,
    /// Eviction order: front is reused first.
    pub(crate) free: VecDeque<u32>,
    pub(crate) ref_cnt: Vec<u32>,
    /// Content (and the real hash, to compare with) of each block registered in the cache.
    pub(crate) registered: Vec<Option<(ContentKey, BlockHash)>>,
    /// Registered blocks per content, in insertion order.
    pub(crate) cache: HashMap<ContentKey, Vec<u32>>,
    pub(crate) stats: PrefixCacheStats,
}

impl Model {
    pub(crate) fn new(cfg: &Config) -> Self {
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
    pub(crate) fn lookup(&mut self, content: &Content) -> Vec<u32> {
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
    pub(crate) fn blocks_to_allocate(
        &self,
        held: &[u32],
        hits: &[u32],
        num_tokens: usize,
    ) -> usize {
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
    pub(crate) fn allocate(
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

    pub(crate) fn unregister(&mut self, block: u32) {
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
    pub(crate) fn free(&mut self, req: &mut ModelRequest) {
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
    pub(crate) fn reset_prefix_cache(&mut self) -> bool {
        if self.ref_cnt.iter().any(|&rc| rc > 0) {
            return false;
        }
        self.cache.clear();
        self.registered.iter_mut().for_each(|r| *r = None);
        true
    }

    pub(crate) fn num_registrations(&self) -> usize {
        self.cache.values().map(Vec::len).sum()
    }
}
