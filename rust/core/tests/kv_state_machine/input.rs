//! Generated input: configurations, operations and their strategies.

use super::*;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    /// Including the null block.
    pub(crate) num_blocks: usize,
    pub(crate) block_size: usize,
    pub(crate) max_model_len: usize,
    pub(crate) caching: bool,
    pub(crate) algo: HashAlgo,
}

/// Token counts are generated in quarter blocks so that every block size sees multi-block prompts.
#[derive(Debug, Clone)]
pub(crate) enum Op {
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
pub(crate) enum Misuse {
    NoNewTokens,
    HitLengthMismatch,
    ComputedPastOwnedSlots,
    BlockIdOutOfRange,
    MissingBlockHashes,
}

#[derive(Debug, Clone)]
pub(crate) struct Step {
    pub(crate) req: Index,
    /// 0: every remaining known token; else at most `chunk_halves` half blocks (chunked prefill).
    pub(crate) chunk_halves: u8,
    /// Unverified draft tokens scheduled after the known ones (never cached).
    pub(crate) num_drafts: u8,
    pub(crate) num_lookahead_tokens: u8,
    pub(crate) full_sequence_must_fit: bool,
    /// False models `skip_reading_prefix_cache`: the request recomputes and so duplicates blocks.
    pub(crate) read_prefix_cache: bool,
    /// Schedule past max_model_len on purpose (the manager must refuse with TooLong).
    pub(crate) past_max_model_len: bool,
}

pub(crate) fn config_strategy() -> impl Strategy<Value = Config> {
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

pub(crate) fn op_strategy() -> impl Strategy<Value = Op> {
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

pub(crate) fn quarters_to_tokens(quarters: u8, block_size: usize) -> usize {
    quarters as usize * block_size / 4
}

/// Deterministic tokens from a seed (a tiny LCG: shrinking the seed keeps the case valid).
pub(crate) fn seeded_tokens(seed: u32, count: usize) -> impl Iterator<Item = u32> {
    let mut state = seed;
    std::iter::repeat_with(move || {
        state = state.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        (state >> 16) % ALPHABET
    })
    .take(count)
}

pub(crate) fn template_token(template: u8, position: usize) -> u32 {
    let t = template as usize;
    ((position * (t + 2) + t) % ALPHABET as usize) as u32
}
