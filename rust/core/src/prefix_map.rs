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
//! - one 64-byte [`Entry`] per block, cache-line aligned: the block's hash, the fingerprint of
//!   its prefix (see [`crate::provenance`]) and its chain links. Registering, verifying or
//!   evicting a block touches this one line;
//! - a flat table of buckets, a power of two at least the pool's size, indexed by the hash's
//!   first bytes. A bucket holds the first and last block of its chain (8 bytes), so finding a
//!   bucket is one line where a general hash map reads its control bytes and then its slot.
//!
//! A chain is doubly linked through the entries in insertion order, so registering and
//! evicting a block cost O(1) even when hundreds of requests computed the same prefix block.
//! Blocks whose hashes share a bucket share its chain; every lookup compares the full 32-byte
//! hash, so sharing costs a longer walk, never a wrong answer. With at most one registration
//! per block and at least one bucket per block, chains average under two entries.

use crate::error::{broken, try_filled_vec, CoreResult};
use crate::hashing::BlockHash;
use crate::provenance::Fingerprint;

/// `next`/`prev` value at either end of a chain.
const END: u32 = u32::MAX;
/// `next` value of a block that is not registered.
const UNREGISTERED: u32 = u32::MAX - 1;

/// The bucket-index bits of a hash: its first 4 bytes.
fn key_of(hash: &BlockHash) -> u32 {
    let mut k = [0u8; 4];
    k.copy_from_slice(&hash[..4]);
    u32::from_le_bytes(k)
}

/// What a block carries while it is registered, in one cache line.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
struct Entry {
    /// The hash the block is registered under (stale when unregistered).
    hash: BlockHash,
    /// Fingerprint of the prefix ending with the block (0 when hits are not verified).
    fingerprint: Fingerprint,
    /// Next block in the chain, [`END`], or [`UNREGISTERED`].
    next: u32,
    /// Previous block in the chain, or [`END`] (stale when unregistered).
    prev: u32,
}

const UNLINKED: Entry = Entry {
    hash: [0; 32],
    fingerprint: 0,
    next: UNREGISTERED,
    prev: END,
};

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

/// Map from block hash to the blocks registered under it, for blocks `0..num_blocks`.
#[derive(Debug, Clone, Default)]
pub struct PrefixMap {
    /// Bucket -> its chain's ends; the length is a power of two.
    buckets: Vec<Chain>,
    /// Per block: hash, fingerprint and links.
    entries: Vec<Entry>,
    num_blocks: usize,
}

impl PrefixMap {
    /// An empty map for blocks `0..num_blocks`, or an error instead of an abort when memory
    /// runs out. `num_blocks == 0` makes a map that is never used (caching off).
    pub fn try_new(num_blocks: usize) -> CoreResult<Self> {
        let num_buckets = if num_blocks == 0 {
            0
        } else {
            num_blocks.next_power_of_two()
        };
        Ok(Self {
            buckets: try_filled_vec(num_buckets, EMPTY, "prefix-cache buckets")?,
            entries: try_filled_vec(num_blocks, UNLINKED, "prefix-cache entries")?,
            num_blocks: 0,
        })
    }

    fn bucket_of(&self, hash: &BlockHash) -> usize {
        key_of(hash) as usize & self.buckets.len().wrapping_sub(1)
    }

    /// Prefetches what registering `block` under `hash` touches: its bucket and its entry.
    pub fn prefetch_insert(&self, hash: &BlockHash, block: u32) {
        if let Some(bucket) = self.buckets.get(self.bucket_of(hash)) {
            crate::prefetch::read(bucket);
        }
        if let Some(entry) = self.entries.get(block as usize) {
            crate::prefetch::read(entry);
        }
    }

    /// Prefetches the entry of `block` (what [`Self::prefetch_remove`] then reads).
    pub fn prefetch_entry(&self, block: u32) {
        if let Some(entry) = self.entries.get(block as usize) {
            crate::prefetch::read(entry);
        }
    }

    /// Prefetches what removing `block` touches besides its entry, which this reads: its
    /// bucket and its chain neighbours' entries.
    pub fn prefetch_remove(&self, block: u32) {
        let Some(entry) = self.entries.get(block as usize) else {
            return;
        };
        if entry.next == UNREGISTERED {
            return;
        }
        crate::prefetch::read(&self.buckets[self.bucket_of(&entry.hash)]);
        for n in [entry.next, entry.prev] {
            if let Some(e) = self.entries.get(n as usize) {
                crate::prefetch::read(e);
            }
        }
    }

    /// Number of (hash, block) registrations.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether `block` is registered (under any hash).
    pub fn is_registered(&self, block: u32) -> bool {
        self.entries
            .get(block as usize)
            .is_some_and(|e| e.next != UNREGISTERED)
    }

    /// The hash `block` is registered under.
    pub fn hash_of(&self, block: u32) -> Option<&BlockHash> {
        self.entries
            .get(block as usize)
            .filter(|e| e.next != UNREGISTERED)
            .map(|e| &e.hash)
    }

    /// The prefix fingerprint recorded with registered `block` (0 if none was given).
    pub fn fingerprint_of(&self, block: u32) -> Option<Fingerprint> {
        self.entries
            .get(block as usize)
            .filter(|e| e.next != UNREGISTERED)
            .map(|e| e.fingerprint)
    }

    /// Every block registered under `hash`, in insertion order.
    pub fn get_all<'a>(&'a self, hash: &'a BlockHash) -> impl Iterator<Item = u32> + 'a {
        let mut cur = if self.buckets.is_empty() {
            END
        } else {
            self.buckets[self.bucket_of(hash)].first
        };
        std::iter::from_fn(move || {
            while cur != END {
                let b = cur;
                let entry = &self.entries[b as usize];
                cur = entry.next;
                if entry.hash == *hash {
                    return Some(b);
                }
            }
            None
        })
    }

    /// The first block registered under `hash`.
    pub fn get_one(&self, hash: &BlockHash) -> Option<u32> {
        self.get_all(hash).next()
    }

    /// Whether `block` is registered under `hash`.
    pub fn contains(&self, hash: &BlockHash, block: u32) -> bool {
        self.hash_of(block) == Some(hash)
    }

    /// Registers `block` under `hash` with the fingerprint of its prefix, after any block
    /// already there. A block already registered is left as it is (returns false).
    pub fn insert(&mut self, hash: BlockHash, block: u32, fingerprint: Fingerprint) -> bool {
        if self.is_registered(block) || block as usize >= self.entries.len() {
            return false;
        }
        let bucket = self.bucket_of(&hash);
        let chain = &mut self.buckets[bucket];
        let prev = chain.last;
        chain.last = block;
        if prev == END {
            chain.first = block;
        } else {
            self.entries[prev as usize].next = block;
        }
        self.entries[block as usize] = Entry {
            hash,
            fingerprint,
            next: END,
            prev,
        };
        self.num_blocks += 1;
        true
    }

    /// Unregisters `block`; returns the hash it was registered under.
    pub fn remove(&mut self, block: u32) -> Option<BlockHash> {
        if !self.is_registered(block) {
            return None;
        }
        let entry = &mut self.entries[block as usize];
        let (after, before, hash) = (entry.next, entry.prev, entry.hash);
        entry.next = UNREGISTERED;
        entry.prev = END;
        self.num_blocks -= 1;
        let bucket = self.bucket_of(&hash);
        match before {
            END => self.buckets[bucket].first = after,
            b => self.entries[b as usize].next = after,
        }
        match after {
            END => self.buckets[bucket].last = before,
            a => self.entries[a as usize].prev = before,
        }
        Some(hash)
    }

    /// Removes `block` from `hash`'s registrations; returns whether it was there.
    pub fn pop(&mut self, hash: &BlockHash, block: u32) -> bool {
        self.contains(hash, block) && self.remove(block).is_some()
    }

    /// Forgets every registration.
    pub fn clear(&mut self) {
        self.buckets.fill(EMPTY);
        self.entries.fill(UNLINKED);
        self.num_blocks = 0;
    }

    /// Every (hash, block) registration reachable from the buckets, chain by chain.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, u32)> + '_ {
        self.buckets.iter().flat_map(move |c| {
            let mut cur = c.first;
            std::iter::from_fn(move || {
                (cur != END && cur != UNREGISTERED).then(|| {
                    let b = cur;
                    cur = self.entries[b as usize].next;
                    (&self.entries[b as usize].hash, b)
                })
            })
        })
    }

    /// Checks the chains: each registered block is reached exactly once, from the bucket of
    /// its own hash, with `prev` mirroring `next` and the buckets' ends matching the chains'.
    pub fn check(&self) -> CoreResult<()> {
        let mut reached = 0usize;
        for (i, chain) in self.buckets.iter().enumerate() {
            let mut before = END;
            let mut cur = chain.first;
            while cur != END {
                let Some(entry) = self
                    .entries
                    .get(cur as usize)
                    .filter(|e| e.next != UNREGISTERED)
                else {
                    return Err(broken!("prefix map chain reaches an unregistered block"));
                };
                if self.bucket_of(&entry.hash) != i || entry.prev != before {
                    return Err(broken!("prefix map chain is inconsistent at block {cur}"));
                }
                reached += 1;
                if reached > self.num_blocks {
                    return Err(broken!("prefix map chains loop or repeat a block"));
                }
                before = cur;
                cur = entry.next;
            }
            if before != chain.last {
                return Err(broken!("prefix map chain of bucket {i} ends elsewhere"));
            }
        }
        let registered = self
            .entries
            .iter()
            .filter(|e| e.next != UNREGISTERED)
            .count();
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
        let mut m = PrefixMap::try_new(8).unwrap();
        assert!(m.insert(key(1), 0, 0));
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(!m.pop(&key(1), 7), "a mismatched id leaves the entry");
        assert!(
            !m.insert(key(2), 0, 0),
            "a registered block is not re-registered"
        );
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(m.pop(&key(1), 0));
        assert_eq!(m.get_one(&key(1)), None);
        assert_eq!(m.num_blocks(), 0);
        m.check().unwrap();
    }

    #[test]
    fn many_blocks_per_hash_keep_insertion_order() {
        let mut m = PrefixMap::try_new(8).unwrap();
        m.insert(key(1), 0, 0);
        m.insert(key(1), 3, 0);
        m.insert(key(1), 5, 0);
        assert_eq!(m.get_all(&key(1)).collect::<Vec<_>>(), [0, 3, 5]);
        assert!(m.pop(&key(1), 0));
        assert_eq!(m.get_one(&key(1)), Some(3));
        assert!(m.contains(&key(1), 5));
        m.check().unwrap();
        assert!(m.pop(&key(1), 5) && m.pop(&key(1), 3));
        assert_eq!(m.num_blocks(), 0);
        m.check().unwrap();
    }

    #[test]
    fn hashes_sharing_a_key_stay_apart() {
        let mut m = PrefixMap::try_new(8).unwrap();
        m.insert(same_key(1), 2, 0);
        m.insert(same_key(2), 4, 0);
        m.insert(same_key(1), 6, 0);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        assert_eq!(m.get_all(&same_key(2)).collect::<Vec<_>>(), [4]);
        assert_eq!(m.get_one(&same_key(3)), None);
        assert!(!m.pop(&same_key(2), 2), "block 2 is under the other hash");
        assert_eq!(m.remove(4), Some(same_key(2)));
        assert_eq!(m.get_one(&same_key(2)), None);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check().unwrap();
        m.insert(same_key(2), 4, 0);
        m.insert(same_key(1), 7, 0);
        assert_eq!(
            m.remove(6),
            Some(same_key(1)),
            "a block in the middle of its chain"
        );
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 7]);
        assert_eq!(
            m.remove(7),
            Some(same_key(1)),
            "the last block of its chain"
        );
        m.insert(same_key(1), 6, 0);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check().unwrap();
        m.clear();
        assert_eq!(m.get_one(&same_key(1)), None);
        assert!(!m.is_registered(2));
        m.check().unwrap();
    }
}
