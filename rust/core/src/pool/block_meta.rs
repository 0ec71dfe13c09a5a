//! The pool's record of one block, in one cache line: its ref count and, while it is in the
//! prefix cache, its hash, prefix fingerprint and chain links.
//!
//! A step allocates, frees, caches and evicts hundreds of blocks scattered over a pool of
//! hundreds of thousands, whose metadata the engine's own work keeps evicting from the caches;
//! a block's cost is the lines it touches. With everything in one aligned 64-byte record,
//! allocating a block (ref count, and evicting its old hash) or registering it touches this
//! one line, plus the prefix bucket (and the free queue's entry, read in order).

use crate::hashing::BlockHash;
use crate::pool::provenance::Fingerprint;

/// `chain_next`/`chain_prev` value at either end of a chain.
pub(crate) const END: u32 = u32::MAX;
/// `chain_next` value of a block that is not registered.
pub(crate) const UNREGISTERED: u32 = u32::MAX - 1;

/// One block's metadata. The prefix map ([`crate::pool::prefix_map`]) owns `hash`, `fingerprint`
/// and the chain links; the block pool owns `ref_cnt`.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct BlockMeta {
    /// The hash the block is registered under (stale when unregistered).
    pub(crate) hash: BlockHash,
    /// Fingerprint of the prefix ending with the block (0 when hits are not verified).
    pub(crate) fingerprint: Fingerprint,
    /// Next block in the prefix chain, the chain's end, or "unregistered".
    pub(crate) chain_next: u32,
    /// Previous block in the prefix chain, or the chain's end (stale when unregistered).
    pub(crate) chain_prev: u32,
    /// Requests holding the block.
    pub(crate) ref_cnt: u32,
}

impl BlockMeta {
    /// A block nobody holds and the prefix cache does not know.
    pub(crate) const EMPTY: Self = Self {
        hash: [0; 32],
        fingerprint: 0,
        chain_next: UNREGISTERED,
        chain_prev: END,
        ref_cnt: 0,
    };
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_cache_line() {
        assert_eq!(std::mem::size_of::<super::BlockMeta>(), 64);
        assert_eq!(std::mem::align_of::<super::BlockMeta>(), 64);
    }
}
