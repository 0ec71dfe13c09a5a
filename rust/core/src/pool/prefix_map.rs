//! Prefix-cache map: block hash -> cached block(s), and what each cached block carries.
//!
//! Several physical blocks may carry the same hash (two requests computed the same prefix before
//! either was cached). They are not de-duplicated, because block ids handed to a request never
//! change; lookups return the first one inserted, and popping removes exactly one block id.
//!
//! Layout, chosen for the hot path (hundreds of inserts and evictions per step in a pool of
//! hundreds of thousands of blocks, whose metadata the engine's own work keeps evicting from
//! the caches, so a step's cost is the cache lines it touches):
//!
//! - a block's hash, prefix fingerprint (see [`super::provenance`]) and chain links live in its
//!   one-line [`BlockMeta`], which the pool owns and passes in, next to its ref count;
//! - a flat table of buckets, a power of two at least the pool's size, indexed by the hash's
//!   first bytes. A bucket holds the first and last block of its chain (8 bytes), so finding a
//!   bucket is one line where a general hash map reads its control bytes and then its slot.
//!
//! A chain is doubly linked through the records in insertion order, so registering and
//! evicting a block cost O(1) even when hundreds of requests computed the same prefix block.
//! Blocks whose hashes share a bucket share its chain; every lookup compares the full 32-byte
//! hash, so sharing costs a longer walk, never a wrong answer. With at most one registration
//! per block and at least one bucket per block, chains average under two entries.

use crate::error::{broken, try_filled_vec, CoreResult};
use crate::hashing::BlockHash;
use crate::pool::block_meta::{BlockMeta, END, UNREGISTERED};
use crate::pool::provenance::Fingerprint;

/// The bucket-index bits of a hash: its first 4 bytes.
fn key_of(hash: &BlockHash) -> u32 {
    let mut k = [0u8; 4];
    k.copy_from_slice(&hash[..4]);
    u32::from_le_bytes(k)
}

/// First and last block of a bucket's chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Chain {
    first: u32,
    last: u32,
}

const EMPTY: Chain = Chain {
    first: END,
    last: END,
};

/// Whether a block's record says it is registered.
fn registered(meta: &BlockMeta) -> bool {
    meta.chain_next != UNREGISTERED
}

/// Map from block hash to the blocks registered under it. The per-block records are the
/// pool's (`meta`, indexed by block id), passed to every call.
#[derive(Debug, Clone, Default)]
pub struct PrefixMap {
    /// Bucket -> its chain's ends; the length is a power of two (0 when caching is off).
    buckets: Vec<Chain>,
    num_blocks: usize,
}

impl PrefixMap {
    /// Bytes [`Self::try_new`] allocates for `num_blocks` blocks.
    pub fn bytes_for(num_blocks: usize) -> u128 {
        let num_buckets = match num_blocks {
            0 => 0,
            n => (n as u128).next_power_of_two(),
        };
        num_buckets * std::mem::size_of::<Chain>() as u128
    }

    /// An empty map for a pool of `num_blocks` blocks, or an error instead of an abort when
    /// memory runs out. `num_blocks == 0` makes a map that is never used (caching off).
    pub fn try_new(num_blocks: usize) -> CoreResult<Self> {
        let num_buckets = if num_blocks == 0 {
            0
        } else {
            num_blocks.next_power_of_two()
        };
        Ok(Self {
            buckets: try_filled_vec(num_buckets, EMPTY, "prefix-cache buckets")?,
            num_blocks: 0,
        })
    }

    fn bucket_of(&self, hash: &BlockHash) -> usize {
        key_of(hash) as usize & self.buckets.len().wrapping_sub(1)
    }

    /// Prefetches what registering a block under `hash` touches besides its record: its bucket.
    pub fn prefetch_bucket(&self, hash: &BlockHash) {
        if let Some(bucket) = self.buckets.get(self.bucket_of(hash)) {
            crate::memory::prefetch::read(bucket);
        }
    }

    /// Prefetches the record of the block a registration under `hash` links after (its
    /// bucket's last block), reading the bucket: the second wave after [`Self::prefetch_bucket`].
    pub fn prefetch_chain_tail(&self, meta: &[BlockMeta], hash: &BlockHash) {
        if let Some(last) = self.buckets.get(self.bucket_of(hash)).map(|c| c.last) {
            if let Some(m) = meta.get(last as usize) {
                crate::memory::prefetch::read(m);
            }
        }
    }

    /// Prefetches what removing `block` touches besides its record, which this reads: its
    /// bucket and its chain neighbours' records.
    pub fn prefetch_remove(&self, meta: &[BlockMeta], block: u32) {
        let Some(m) = meta.get(block as usize).filter(|m| registered(m)) else {
            return;
        };
        self.prefetch_bucket(&m.hash);
        for n in [m.chain_next, m.chain_prev] {
            if let Some(e) = meta.get(n as usize) {
                crate::memory::prefetch::read(e);
            }
        }
    }

    /// Number of (hash, block) registrations.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether `block` is registered (under any hash).
    pub fn is_registered(&self, meta: &[BlockMeta], block: u32) -> bool {
        meta.get(block as usize).is_some_and(registered)
    }

    /// The hash `block` is registered under.
    pub fn hash_of<'a>(&self, meta: &'a [BlockMeta], block: u32) -> Option<&'a BlockHash> {
        meta.get(block as usize)
            .filter(|m| registered(m))
            .map(|m| &m.hash)
    }

    /// The prefix fingerprint recorded with registered `block` (0 if none was given).
    pub fn fingerprint_of(&self, meta: &[BlockMeta], block: u32) -> Option<Fingerprint> {
        meta.get(block as usize)
            .filter(|m| registered(m))
            .map(|m| m.fingerprint)
    }

    /// Every block registered under `hash`, in insertion order.
    pub fn get_all<'a>(
        &'a self,
        meta: &'a [BlockMeta],
        hash: &'a BlockHash,
    ) -> impl Iterator<Item = u32> + 'a {
        let mut cur = if self.buckets.is_empty() {
            END
        } else {
            self.buckets[self.bucket_of(hash)].first
        };
        std::iter::from_fn(move || {
            while cur != END {
                let b = cur;
                let m = &meta[b as usize];
                cur = m.chain_next;
                if m.hash == *hash {
                    return Some(b);
                }
            }
            None
        })
    }

    /// The first block registered under `hash`.
    pub fn get_one(&self, meta: &[BlockMeta], hash: &BlockHash) -> Option<u32> {
        self.get_all(meta, hash).next()
    }

    /// Whether `block` is registered under `hash`.
    #[cfg(test)]
    pub fn contains(&self, meta: &[BlockMeta], hash: &BlockHash, block: u32) -> bool {
        self.hash_of(meta, block) == Some(hash)
    }

    /// Registers `block` under `hash` with the fingerprint of its prefix, after any block
    /// already there. A block already registered is left as it is (returns false).
    pub fn insert(
        &mut self,
        meta: &mut [BlockMeta],
        hash: BlockHash,
        block: u32,
        fingerprint: Fingerprint,
    ) -> bool {
        if self.buckets.is_empty() || meta.get(block as usize).is_none_or(registered) {
            return false;
        }
        let bucket = self.bucket_of(&hash);
        let chain = &mut self.buckets[bucket];
        let prev = chain.last;
        chain.last = block;
        if prev == END {
            chain.first = block;
        } else {
            meta[prev as usize].chain_next = block;
        }
        let m = &mut meta[block as usize];
        m.hash = hash;
        m.fingerprint = fingerprint;
        m.chain_next = END;
        m.chain_prev = prev;
        self.num_blocks += 1;
        true
    }

    /// Unregisters `block`; returns the hash it was registered under.
    pub fn remove(&mut self, meta: &mut [BlockMeta], block: u32) -> Option<BlockHash> {
        let m = meta.get_mut(block as usize).filter(|m| registered(m))?;
        let (after, before, hash) = (m.chain_next, m.chain_prev, m.hash);
        m.chain_next = UNREGISTERED;
        m.chain_prev = END;
        self.num_blocks -= 1;
        let bucket = self.bucket_of(&hash);
        match before {
            END => self.buckets[bucket].first = after,
            b => meta[b as usize].chain_next = after,
        }
        match after {
            END => self.buckets[bucket].last = before,
            a => meta[a as usize].chain_prev = before,
        }
        Some(hash)
    }

    /// Removes `block` from `hash`'s registrations; returns whether it was there.
    #[cfg(test)]
    pub fn pop(&mut self, meta: &mut [BlockMeta], hash: &BlockHash, block: u32) -> bool {
        self.contains(meta, hash, block) && self.remove(meta, block).is_some()
    }

    /// Forgets every registration.
    pub fn clear(&mut self, meta: &mut [BlockMeta]) {
        self.buckets.fill(EMPTY);
        for m in meta {
            m.chain_next = UNREGISTERED;
            m.chain_prev = END;
        }
        self.num_blocks = 0;
    }

    /// Checks the chains: each registered block is reached exactly once, from the bucket of
    /// its own hash, with `chain_prev` mirroring `chain_next` and the buckets' ends matching
    /// the chains'.
    pub fn check(&self, meta: &[BlockMeta]) -> CoreResult<()> {
        let mut reached = 0usize;
        for (i, chain) in self.buckets.iter().enumerate() {
            let mut before = END;
            let mut cur = chain.first;
            while cur != END {
                let Some(m) = meta.get(cur as usize).filter(|m| registered(m)) else {
                    return Err(broken!("prefix map chain reaches an unregistered block"));
                };
                if self.bucket_of(&m.hash) != i || m.chain_prev != before {
                    return Err(broken!("prefix map chain is inconsistent at block {cur}"));
                }
                reached += 1;
                if reached > self.num_blocks {
                    return Err(broken!("prefix map chains loop or repeat a block"));
                }
                before = cur;
                cur = m.chain_next;
            }
            if before != chain.last {
                return Err(broken!("prefix map chain of bucket {i} ends elsewhere"));
            }
        }
        let registered = meta.iter().filter(|m| registered(m)).count();
        if reached != self.num_blocks || registered != self.num_blocks {
            return Err(broken!(
                "prefix map counts {} registrations, chains reach {reached}, blocks carry {registered}",
                self.num_blocks
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map over 8 blocks and their records.
    fn map8() -> (PrefixMap, Vec<BlockMeta>) {
        (PrefixMap::try_new(8).unwrap(), vec![BlockMeta::EMPTY; 8])
    }

    fn key(i: u8) -> BlockHash {
        [i; 32]
    }

    /// Two hashes that share the 4-byte map key but differ after it.
    fn same_key(i: u8) -> BlockHash {
        let mut h = [1; 32];
        h[31] = i;
        h
    }

    #[test]
    fn single_block_per_key() {
        let (mut m, mut meta) = map8();
        assert!(m.insert(&mut meta, key(1), 0, 0));
        assert_eq!(m.get_one(&meta, &key(1)), Some(0));
        assert!(
            !m.pop(&mut meta, &key(1), 7),
            "a mismatched id leaves the entry"
        );
        assert!(
            !m.insert(&mut meta, key(2), 0, 0),
            "a registered block is not re-registered"
        );
        assert_eq!(m.get_one(&meta, &key(1)), Some(0));
        assert!(m.pop(&mut meta, &key(1), 0));
        assert_eq!(m.get_one(&meta, &key(1)), None);
        assert_eq!(m.num_blocks(), 0);
        m.check(&meta).unwrap();
    }

    #[test]
    fn many_blocks_per_hash_keep_insertion_order() {
        let (mut m, mut meta) = map8();
        m.insert(&mut meta, key(1), 0, 0);
        m.insert(&mut meta, key(1), 3, 0);
        m.insert(&mut meta, key(1), 5, 0);
        assert_eq!(m.get_all(&meta, &key(1)).collect::<Vec<_>>(), [0, 3, 5]);
        assert!(m.pop(&mut meta, &key(1), 0));
        assert_eq!(m.get_one(&meta, &key(1)), Some(3));
        assert!(m.contains(&meta, &key(1), 5));
        m.check(&meta).unwrap();
        assert!(m.pop(&mut meta, &key(1), 5) && m.pop(&mut meta, &key(1), 3));
        assert_eq!(m.num_blocks(), 0);
        m.check(&meta).unwrap();
    }

    #[test]
    fn hashes_sharing_a_key_stay_apart() {
        let (mut m, mut meta) = map8();
        m.insert(&mut meta, same_key(1), 2, 0);
        m.insert(&mut meta, same_key(2), 4, 0);
        m.insert(&mut meta, same_key(1), 6, 0);
        assert_eq!(m.get_all(&meta, &same_key(1)).collect::<Vec<_>>(), [2, 6]);
        assert_eq!(m.get_all(&meta, &same_key(2)).collect::<Vec<_>>(), [4]);
        assert_eq!(m.get_one(&meta, &same_key(3)), None);
        assert!(
            !m.pop(&mut meta, &same_key(2), 2),
            "block 2 is under the other hash"
        );
        assert_eq!(m.remove(&mut meta, 4), Some(same_key(2)));
        assert_eq!(m.get_one(&meta, &same_key(2)), None);
        assert_eq!(m.get_all(&meta, &same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check(&meta).unwrap();
        m.insert(&mut meta, same_key(2), 4, 0);
        m.insert(&mut meta, same_key(1), 7, 0);
        assert_eq!(
            m.remove(&mut meta, 6),
            Some(same_key(1)),
            "a block in the middle of its chain"
        );
        assert_eq!(m.get_all(&meta, &same_key(1)).collect::<Vec<_>>(), [2, 7]);
        assert_eq!(
            m.remove(&mut meta, 7),
            Some(same_key(1)),
            "the last block of its chain"
        );
        m.insert(&mut meta, same_key(1), 6, 0);
        assert_eq!(m.get_all(&meta, &same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check(&meta).unwrap();
        m.clear(&mut meta);
        assert_eq!(m.get_one(&meta, &same_key(1)), None);
        assert!(!m.is_registered(&meta, 2));
        m.check(&meta).unwrap();
    }
}
