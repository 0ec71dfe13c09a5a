//! What each prefix-cached block was computed from, so that a hit is verified, not trusted.
//!
//! A block hash stands for the whole token prefix up to the end of its block (the hashes are
//! chained) plus the request's extra keys (LoRA name, cache salt). With SHA-256 a collision is
//! infeasible, but the cache is shared between tenants, so a hit is also checked against what
//! the block was cached with: its own tokens, exactly, and a fingerprint of the whole prefix
//! and extra keys, chained like the block hashes but computed independently of them (keyed
//! XXH3-128 with a per-pool random key). A hit counts only if both match the request, so a
//! collision of the block hash alone (which tests force with a test-only hash) can never hand
//! one request KV computed for another prefix or tenant.

use std::hash::{BuildHasher, Hasher};

use xxhash_rust::xxh3::{xxh3_128_with_seed, Xxh3};

use crate::error::{try_filled_vec, CoreResult};
use crate::hashing::ExtraKeys;

/// Blocks up to this many tokens are fingerprinted from a stack buffer in one call.
const STACK_TOKENS: usize = 64;

/// Fingerprint of a token prefix and extra keys.
pub type Fingerprint = u128;

/// The tokens every cached block holds, and the key of the prefix fingerprints (which the
/// prefix map keeps with each block's hash, in the same cache line).
#[derive(Debug, Clone)]
pub struct Provenance {
    block_size: usize,
    /// Key of the fingerprints, random per pool.
    key: u64,
    /// `[num_blocks * block_size]` tokens each cached block holds.
    tokens: Vec<u32>,
}

impl Provenance {
    /// Bytes [`Self::try_new`] allocates for `num_blocks` blocks of `block_size` tokens.
    pub fn bytes_for(num_blocks: usize, block_size: usize) -> u128 {
        (num_blocks as u128)
            .saturating_mul(block_size as u128)
            .saturating_mul(std::mem::size_of::<u32>() as u128)
    }

    /// Room for `num_blocks` blocks of `block_size` tokens.
    pub fn try_new(num_blocks: usize, block_size: usize) -> CoreResult<Self> {
        let num_tokens = num_blocks.saturating_mul(block_size);
        let mut seed = std::collections::hash_map::RandomState::new().build_hasher();
        seed.write_usize(num_blocks);
        Ok(Self {
            block_size,
            key: seed.finish(),
            tokens: try_filled_vec(num_tokens, 0, "prefix-cache token copies")?,
        })
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The fingerprint of a prefix whose last block, block `index`, holds `tokens`, chained to
    /// `parent` (the fingerprint of the prefix before it; `None` for a sequence's first block).
    pub fn chain(
        &self,
        parent: Option<Fingerprint>,
        tokens: &[u32],
        extra: &ExtraKeys,
        index: usize,
    ) -> Fingerprint {
        let mut parent = parent.unwrap_or_else(|| self.root(extra));
        if let Some(key) = extra.block_key(index) {
            // A prompt given as embeddings: its placeholder tokens say nothing, its digest does.
            let mut bytes = [0u8; 16 + crate::hashing::HASH_BYTES];
            bytes[..16].copy_from_slice(&parent.to_le_bytes());
            bytes[16..].copy_from_slice(key);
            parent = xxh3_128_with_seed(&bytes, self.key);
        }
        // One-shot XXH3 over a stack buffer: the streaming state would derive a seeded secret
        // on every call, which costs more than hashing a block. The usual block sizes get a
        // buffer of their exact size, which is written whole and so never zeroed first.
        match tokens.len() {
            16 => return self.chain_exact::<16, { 16 + 4 * 16 }>(parent, tokens),
            32 => return self.chain_exact::<32, { 16 + 4 * 32 }>(parent, tokens),
            _ => {}
        }
        let mut buf = [0u8; 16 + 4 * STACK_TOKENS];
        if tokens.len() <= STACK_TOKENS {
            buf[..16].copy_from_slice(&parent.to_le_bytes());
            for (dst, t) in buf[16..].chunks_exact_mut(4).zip(tokens) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            return xxh3_128_with_seed(&buf[..16 + 4 * tokens.len()], self.key);
        }
        let mut h = Xxh3::with_seed(self.key);
        h.update(&parent.to_le_bytes());
        for chunk in tokens.chunks(STACK_TOKENS) {
            for (dst, t) in buf.chunks_exact_mut(4).zip(chunk) {
                dst.copy_from_slice(&t.to_le_bytes());
            }
            h.update(&buf[..4 * chunk.len()]);
        }
        h.digest128()
    }

    /// [`Self::chain`] for a block of exactly `N` tokens (`BYTES` = 16 + 4 `N`).
    fn chain_exact<const N: usize, const BYTES: usize>(
        &self,
        parent: Fingerprint,
        tokens: &[u32],
    ) -> Fingerprint {
        const { assert!(BYTES == 16 + 4 * N) };
        let tokens: &[u32; N] = tokens.try_into().expect("a block of N tokens");
        let mut buf = [0u8; BYTES];
        buf[..16].copy_from_slice(&parent.to_le_bytes());
        for (dst, t) in buf[16..].chunks_exact_mut(4).zip(tokens) {
            dst.copy_from_slice(&t.to_le_bytes());
        }
        xxh3_128_with_seed(&buf, self.key)
    }

    /// The fingerprint a sequence's first block chains to: the extra keys alone.
    fn root(&self, extra: &ExtraKeys) -> Fingerprint {
        let mut h = Xxh3::with_seed(self.key);
        for key in [&extra.lora_name, &extra.cache_salt] {
            match key {
                Some(s) => {
                    h.update(&[1]);
                    h.update(&(s.len() as u64).to_le_bytes());
                    h.update(s.as_bytes());
                }
                None => h.update(&[0]),
            }
        }
        h.digest128()
    }

    /// Prefetches the token copy of `block` (its first line; a block of 16 tokens is one line).
    pub fn prefetch(&self, block: u32) {
        if let Some(t) = self.tokens.get(block as usize * self.block_size) {
            crate::memory::prefetch::read(t);
        }
    }

    /// Records the tokens `block` holds as it enters the cache.
    pub fn record(&mut self, block: u32, tokens: &[u32]) {
        let b = block as usize;
        debug_assert_eq!(tokens.len(), self.block_size);
        self.tokens[b * self.block_size..(b + 1) * self.block_size].copy_from_slice(tokens);
    }

    /// Whether cached `block` holds exactly `tokens`.
    pub fn holds(&self, block: u32, tokens: &[u32]) -> bool {
        let b = block as usize;
        self.tokens[b * self.block_size..(b + 1) * self.block_size] == *tokens
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every block size fingerprints the same bytes: the parent, then the tokens, little-endian.
    #[test]
    fn every_block_size_hashes_the_same_encoding() {
        let prov = Provenance::try_new(4, 16).expect("provenance");
        for len in [1, 8, 16, 32, 48, 64, 100] {
            let tokens: Vec<u32> = (0..len).map(|t| t * 7919 + 3).collect();
            let parent: Fingerprint = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;
            let mut bytes = parent.to_le_bytes().to_vec();
            bytes.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
            assert_eq!(
                prov.chain(Some(parent), &tokens, &ExtraKeys::default(), 1),
                xxh3_128_with_seed(&bytes, prov.key),
                "{len} tokens"
            );
        }
    }
}
