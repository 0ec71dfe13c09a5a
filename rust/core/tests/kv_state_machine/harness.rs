//! Checks of the manager against the model, and the harness that applies operations to both.

use super::*;

/// Everything observable about the real manager, to prove an operation changed nothing.
#[derive(Debug, PartialEq)]
pub(crate) struct Snapshot {
    pub(crate) free: Vec<u32>,
    pub(crate) ref_cnt: Vec<u32>,
    pub(crate) hashes: Vec<Option<BlockHash>>,
    pub(crate) requests: Vec<RequestBlocks>,
    pub(crate) stats: PrefixCacheStats,
}

impl Snapshot {
    pub(crate) fn take(mgr: &KvCacheManager, live: &[Request]) -> Self {
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

pub(crate) fn fail(e: CoreError) -> TestCaseError {
    TestCaseError::fail(e.to_string())
}

/// Real manager == model, plus invariants 1, 2, 5, 7 (§7) checked directly.
pub(crate) fn check_all(
    mgr: &KvCacheManager,
    model: &Model,
    live: &[Request],
) -> Result<(), TestCaseError> {
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
pub(crate) fn check_request_hashes(
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

// Applying operations

/// How often the interesting paths ran, so a generator change that starves one shows up.
#[derive(Debug, Default)]
pub(crate) struct Coverage {
    pub(crate) hits: Cell<u64>,
    pub(crate) hits_on_free_blocks: Cell<u64>,
    pub(crate) allocated: Cell<u64>,
    pub(crate) no_room: Cell<u64>,
    pub(crate) too_long: Cell<u64>,
    pub(crate) evictions: Cell<u64>,
    pub(crate) duplicate_keys: Cell<u64>,
    pub(crate) resets: Cell<u64>,
    pub(crate) refused_resets: Cell<u64>,
    pub(crate) refused_misuse: Cell<u64>,
    pub(crate) withdrawn_entries: Cell<u64>,
}

pub(crate) fn bump(counter: &Cell<u64>) {
    counter.set(counter.get() + 1);
}

pub(crate) struct Harness<'a> {
    pub(crate) cfg: Config,
    pub(crate) mgr: KvCacheManager,
    pub(crate) model: Model,
    pub(crate) hasher: BlockHasher,
    pub(crate) live: Vec<Request>,
    pub(crate) coverage: &'a Coverage,
}

impl<'a> Harness<'a> {
    pub(crate) fn new(cfg: Config, coverage: &'a Coverage) -> Self {
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

    pub(crate) fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
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
    pub(crate) fn rehash(&self, content: &mut Content) {
        if self.cfg.caching {
            let extra = content.extra_keys();
            self.hasher
                .extend_hashes(&mut content.hashes, &content.tokens, &extra);
        }
    }

    pub(crate) fn schedule(&mut self, step: &Step) -> Result<(), TestCaseError> {
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
    pub(crate) fn check_allocation(
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
    pub(crate) fn free(&mut self, i: usize) -> Result<(), TestCaseError> {
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
    pub(crate) fn misuse(&mut self, i: usize, kind: Misuse) -> Result<(), TestCaseError> {
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
    pub(crate) fn undo_last_step(&mut self, i: usize) -> Result<(), TestCaseError> {
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
    pub(crate) fn reset_prefix_cache(&mut self) -> Result<(), TestCaseError> {
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

pub(crate) fn extra_of(lora: Option<u8>, salt: Option<u8>) -> ExtraKeys {
    ExtraKeys {
        lora_name: lora.map(|l| format!("lora-{l}")),
        cache_salt: salt.map(|s| format!("salt-{s}")),
        ..Default::default()
    }
}

pub(crate) fn empty_content() -> Content {
    Content {
        lora: None,
        salt: None,
        extra: ExtraKeys::default(),
        tokens: Vec::new(),
        hashes: Vec::new(),
    }
}

pub(crate) fn run_case(cfg: Config, ops: &[Op], coverage: &Coverage) -> Result<(), TestCaseError> {
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
