//! A request as the KV-cache manager sees it: the blocks it holds and a view of its tokens.
//!
//! The manager keeps no request state: the caller stores a [`RequestBlocks`] with each request
//! and passes it in with a [`SequenceView`] of the request's tokens.

use crate::hashing::{BlockHash, ExtraKeys};
use crate::pool::provenance::Fingerprint;

/// Blocks held by one request, in logical order, and how many leading ones are in the prefix cache.
///
/// `repr(C)`: the block ids and the cached count, which every step reads, come first; the
/// fingerprint, read only when blocks are registered, last, stored at 8-byte alignment so that
/// the record packs into the request's hot line (`Request`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[repr(C)]
pub struct RequestBlocks {
    /// Block ids; entry `i` holds positions `[i * block_size, (i + 1) * block_size)`.
    pub block_ids: Vec<u32>,
    /// Leading blocks already registered in the prefix cache (never re-registered).
    pub num_cached_blocks: usize,
    /// Fingerprint of the prefix those leading blocks hold, when known (hit verification on):
    /// the next blocks cached chain to it without reading the pool's entry of the last one.
    pub(crate) cached_fingerprint: Option<StoredFingerprint>,
}

impl RequestBlocks {
    /// Fingerprint of the prefix the leading cached blocks hold, when known.
    pub fn cached_fingerprint(&self) -> Option<Fingerprint> {
        self.cached_fingerprint.map(|s| s.0)
    }

    /// Records the fingerprint of the prefix the leading cached blocks hold.
    pub(crate) fn set_cached_fingerprint(&mut self, fingerprint: Option<Fingerprint>) {
        self.cached_fingerprint = fingerprint.map(StoredFingerprint);
    }
}

/// A [`Fingerprint`] kept at 8-byte alignment (a `u128` alone would align its record to 16
/// bytes and pad it); read and written by copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C, packed(8))]
pub(crate) struct StoredFingerprint(Fingerprint);

/// What the manager needs to know about a request's token sequence.
#[derive(Debug, Clone, Copy)]
pub struct SequenceView<'a> {
    /// Known tokens (prompt + accepted outputs; never drafts).
    pub tokens: &'a [u32],
    /// Chained hashes of every full block of the known tokens (may be empty when caching is off).
    pub block_hashes: &'a [BlockHash],
    /// The request's extra keys (LoRA name, cache salt), checked on prefix-cache hits.
    pub extra: &'a ExtraKeys,
}

impl SequenceView<'_> {
    /// Number of known tokens.
    pub fn num_tokens(&self) -> usize {
        self.tokens.len()
    }
}
