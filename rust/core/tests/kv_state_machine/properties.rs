//! The properties: the manager against the model on random operation sequences, and hashing
//! (invariant 8) and the free queue on their own.

use super::*;

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

// Hashing (invariant 8) and the free queue on their own.

#[derive(Debug, Clone)]
pub(crate) enum HashChange {
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
