//! Prefix-cache map: block hash -> cached block(s), and block -> the hash it is cached under.
//!
//! Several physical blocks may carry the same hash (two requests computed the same prefix before
//! either was cached). They are not de-duplicated, because block ids handed to a request never
//! change; lookups return the first one inserted, and popping removes exactly one block id.
//!
//! Layout, chosen for the hot path (hundreds of inserts and evictions per step in a pool of
//! hundreds of thousands of blocks): the hash map is keyed by the hash's first 4 bytes and holds
//! only the first and last block of the chain of blocks under that key, 12 bytes a bucket (a
//! pool of 250,000 blocks needs 6 MB, which stays in cache where 32-byte keys did not). The
//! chain is doubly linked through per-block links (next, previous, and the key, so evicting
//! a block reads one 12-byte entry before the map) in insertion order, so
//! registering and evicting a block cost O(1) even when hundreds of requests computed the same
//! prefix block, and every lookup compares the full 32-byte hash kept per block: a key
//! collision costs a longer walk, never a wrong answer.
//!
//! The map itself starts small and grows with the number of cached blocks; the per-block
//! arrays are allocated once for the pool.

use hashbrown::hash_map::Entry;
use hashbrown::HashMap;

use crate::error::{broken, try_filled_vec, CoreError, CoreResult};
use crate::hashing::BlockHash;

/// Keys the map has room for before it first grows. The map then grows with what is cached
/// (to one key per block at most): a map sized for a large pool from the start spreads a
/// step's inserts over more memory than the cache holds, which measured about 15% slower
/// per decode step at 1,024 requests (`examples/step_cost`).
const INITIAL_KEYS: usize = 1 << 16;

/// `next`/`prev` value at either end of a chain.
const END: u32 = u32::MAX;
/// `next` value of a block that is not registered.
const UNREGISTERED: u32 = u32::MAX - 1;

/// The map key of a hash: its first 4 bytes.
fn key_of(hash: &BlockHash) -> u32 {
    let mut k = [0u8; 4];
    k.copy_from_slice(&hash[..4]);
    u32::from_le_bytes(k)
}

/// A block's place in its key's chain, and the key (so evicting a block reads one line).
#[derive(Debug, Clone, Copy)]
struct Link {
    /// Next block in the chain, [`END`], or [`UNREGISTERED`].
    next: u32,
    /// Previous block in the chain, or [`END`] (stale when unregistered).
    prev: u32,
    /// The map key of the block's hash (stale when unregistered).
    key: u32,
}

const UNLINKED: Link = Link {
    next: UNREGISTERED,
    prev: END,
    key: 0,
};

/// First and last block of a key's chain.
#[derive(Debug, Clone, Copy)]
struct Chain {
    first: u32,
    last: u32,
}

/// Map from block hash to the blocks registered under it, for blocks `0..num_blocks`.
#[derive(Debug, Clone, Default)]
pub struct PrefixMap {
    /// Key -> its chain's ends.
    chains: HashMap<u32, Chain>,
    /// The hash each registered block carries (stale for unregistered blocks).
    hashes: Vec<BlockHash>,
    /// Each block's chain links.
    links: Vec<Link>,
    num_blocks: usize,
}

impl PrefixMap {
    /// An empty map for blocks `0..num_blocks`, or an error instead of an abort when memory
    /// runs out. `num_blocks == 0` makes a map that is never used (caching off).
    pub fn try_new(num_blocks: usize) -> CoreResult<Self> {
        let mut chains = HashMap::new();
        chains
            .try_reserve(num_blocks.min(INITIAL_KEYS))
            .map_err(|_| {
                CoreError::InvalidArgument(format!(
                    "cannot allocate a prefix cache of {num_blocks} blocks: out of memory"
                ))
            })?;
        Ok(Self {
            chains,
            hashes: try_filled_vec(num_blocks, [0; 32], "prefix-cache block hashes")?,
            links: try_filled_vec(num_blocks, UNLINKED, "prefix-cache chains")?,
            num_blocks: 0,
        })
    }

    /// Number of (hash, block) registrations.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Whether `block` is registered (under any hash).
    pub fn is_registered(&self, block: u32) -> bool {
        self.links
            .get(block as usize)
            .is_some_and(|l| l.next != UNREGISTERED)
    }

    /// The hash `block` is registered under.
    pub fn hash_of(&self, block: u32) -> Option<&BlockHash> {
        self.is_registered(block)
            .then(|| &self.hashes[block as usize])
    }

    /// Every block registered under `hash`, in insertion order.
    pub fn get_all<'a>(&'a self, hash: &'a BlockHash) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.chains.get(&key_of(hash)).map_or(END, |c| c.first);
        std::iter::from_fn(move || {
            while cur != END {
                let b = cur;
                cur = self.links[b as usize].next;
                if self.hashes[b as usize] == *hash {
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

    /// Registers `block` under `hash`, after any block already there. A block already
    /// registered is left as it is (returns false); so is every block when the map cannot grow
    /// (out of memory): an unregistered block is only a missed cache hit.
    pub fn insert(&mut self, hash: BlockHash, block: u32) -> bool {
        if self.is_registered(block) || self.chains.try_reserve(1).is_err() {
            return false;
        }
        let b = block as usize;
        let key = key_of(&hash);
        self.hashes[b] = hash;
        self.num_blocks += 1;
        let prev = match self.chains.entry(key) {
            Entry::Vacant(e) => {
                e.insert(Chain {
                    first: block,
                    last: block,
                });
                END
            }
            Entry::Occupied(mut e) => {
                let chain = e.get_mut();
                let last = std::mem::replace(&mut chain.last, block);
                self.links[last as usize].next = block;
                last
            }
        };
        self.links[b] = Link {
            next: END,
            prev,
            key,
        };
        true
    }

    /// Unregisters `block`; returns the hash it was registered under.
    pub fn remove(&mut self, block: u32) -> Option<BlockHash> {
        if !self.is_registered(block) {
            return None;
        }
        let b = block as usize;
        let Link {
            next: after,
            prev: before,
            key,
        } = std::mem::replace(&mut self.links[b], UNLINKED);
        self.num_blocks -= 1;
        if before != END {
            self.links[before as usize].next = after;
        }
        if after != END {
            self.links[after as usize].prev = before;
        }
        if before == END || after == END {
            if let Entry::Occupied(mut e) = self.chains.entry(key) {
                if before == END && after == END {
                    e.remove();
                } else if before == END {
                    e.get_mut().first = after;
                } else {
                    e.get_mut().last = before;
                }
            } else {
                debug_assert!(false, "registered block {block} has no chain");
            }
        }
        Some(self.hashes[b])
    }

    /// Removes `block` from `hash`'s registrations; returns whether it was there.
    pub fn pop(&mut self, hash: &BlockHash, block: u32) -> bool {
        self.contains(hash, block) && self.remove(block).is_some()
    }

    /// Forgets every registration.
    pub fn clear(&mut self) {
        self.chains.clear();
        self.links.iter_mut().for_each(|l| *l = UNLINKED);
        self.num_blocks = 0;
    }

    /// Every (hash, block) registration reachable from the map, chain by chain.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, u32)> + '_ {
        self.chains.values().flat_map(move |c| {
            let mut cur = c.first;
            std::iter::from_fn(move || {
                (cur != END && cur != UNREGISTERED).then(|| {
                    let b = cur;
                    cur = self.links[b as usize].next;
                    (&self.hashes[b as usize], b)
                })
            })
        })
    }

    /// Checks the chains: each registered block is reached exactly once, from the chain of its
    /// own key, with `prev` mirroring `next` and the map's ends matching the chain's.
    pub fn check(&self) -> CoreResult<()> {
        let mut reached = 0usize;
        for (&key, chain) in &self.chains {
            let mut before = END;
            let mut cur = chain.first;
            while cur != END {
                let b = cur as usize;
                let Some(link) = self.links.get(b).filter(|l| l.next != UNREGISTERED) else {
                    return Err(broken!("prefix map chain reaches an unregistered block"));
                };
                if key_of(&self.hashes[b]) != key || link.key != key || link.prev != before {
                    return Err(broken!("prefix map chain is inconsistent at block {cur}"));
                }
                reached += 1;
                if reached > self.num_blocks {
                    return Err(broken!("prefix map chains loop or repeat a block"));
                }
                before = cur;
                cur = link.next;
            }
            if before != chain.last {
                return Err(broken!("prefix map chain of key {key:#x} ends elsewhere"));
            }
        }
        let registered = self.links.iter().filter(|l| l.next != UNREGISTERED).count();
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
        assert!(m.insert(key(1), 0));
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(!m.pop(&key(1), 7), "a mismatched id leaves the entry");
        assert!(
            !m.insert(key(2), 0),
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
        m.insert(key(1), 0);
        m.insert(key(1), 3);
        m.insert(key(1), 5);
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
        m.insert(same_key(1), 2);
        m.insert(same_key(2), 4);
        m.insert(same_key(1), 6);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        assert_eq!(m.get_all(&same_key(2)).collect::<Vec<_>>(), [4]);
        assert_eq!(m.get_one(&same_key(3)), None);
        assert!(!m.pop(&same_key(2), 2), "block 2 is under the other hash");
        assert_eq!(m.remove(4), Some(same_key(2)));
        assert_eq!(m.get_one(&same_key(2)), None);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check().unwrap();
        m.insert(same_key(2), 4);
        m.insert(same_key(1), 7);
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
        m.insert(same_key(1), 6);
        assert_eq!(m.get_all(&same_key(1)).collect::<Vec<_>>(), [2, 6]);
        m.check().unwrap();
        m.clear();
        assert_eq!(m.get_one(&same_key(1)), None);
        assert!(!m.is_registered(2));
        m.check().unwrap();
    }
}
