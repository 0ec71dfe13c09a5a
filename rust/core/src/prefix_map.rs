//! Prefix-cache map: block hash -> cached block(s).
//!
//! Several physical blocks may carry the same hash (two requests computed the same prefix before
//! either was cached). They are not de-duplicated, because block ids handed to a request never
//! change; lookups return the first one inserted, and popping removes exactly one block id.

use hashbrown::HashMap;

use crate::error::{CoreError, CoreResult};
use crate::hashing::BlockHash;

#[derive(Debug, Clone)]
enum Entry {
    One(u32),
    /// Insertion order; never empty, never a single element.
    Many(Vec<u32>),
}

/// Map from block hash to the blocks registered under it.
#[derive(Debug, Clone, Default)]
pub struct PrefixMap {
    map: HashMap<BlockHash, Entry>,
    num_blocks: usize,
}

impl PrefixMap {
    /// An empty map with room for `capacity` keys (no rehash while the pool fills), or an
    /// error instead of an abort when memory runs out.
    pub fn try_with_capacity(capacity: usize) -> CoreResult<Self> {
        let mut map = HashMap::new();
        map.try_reserve(capacity).map_err(|_| {
            CoreError::InvalidArgument(format!(
                "cannot allocate a prefix cache of {capacity} blocks: out of memory"
            ))
        })?;
        Ok(Self { map, num_blocks: 0 })
    }

    /// Number of distinct hashes.
    pub fn num_keys(&self) -> usize {
        self.map.len()
    }

    /// Number of (hash, block) registrations.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The first block registered under `hash`.
    pub fn get_one(&self, hash: &BlockHash) -> Option<u32> {
        match self.map.get(hash)? {
            Entry::One(b) => Some(*b),
            Entry::Many(v) => v.first().copied(),
        }
    }

    /// Every block registered under `hash`, in insertion order.
    pub fn get_all(&self, hash: &BlockHash) -> &[u32] {
        match self.map.get(hash) {
            Some(Entry::One(b)) => std::slice::from_ref(b),
            Some(Entry::Many(v)) => v,
            None => &[],
        }
    }

    /// Whether `block` is registered under `hash`.
    pub fn contains(&self, hash: &BlockHash, block: u32) -> bool {
        match self.map.get(hash) {
            Some(Entry::One(b)) => *b == block,
            Some(Entry::Many(v)) => v.contains(&block),
            None => false,
        }
    }

    /// Registers `block` under `hash` (after any block already there).
    pub fn insert(&mut self, hash: BlockHash, block: u32) {
        self.num_blocks += 1;
        match self.map.entry(hash) {
            hashbrown::hash_map::Entry::Vacant(e) => {
                e.insert(Entry::One(block));
            }
            hashbrown::hash_map::Entry::Occupied(mut e) => {
                let entry = e.get_mut();
                match entry {
                    Entry::One(first) => *entry = Entry::Many(vec![*first, block]),
                    Entry::Many(v) => v.push(block),
                }
            }
        }
    }

    /// Removes `block` from `hash`'s registrations; returns whether it was there.
    pub fn pop(&mut self, hash: &BlockHash, block: u32) -> bool {
        // One probe of the map: the entry API finds the key once for the read and the removal.
        let hashbrown::hash_map::Entry::Occupied(mut slot) = self.map.entry(*hash) else {
            return false;
        };
        let removed = match slot.get_mut() {
            Entry::One(b) if *b == block => {
                slot.remove();
                true
            }
            Entry::One(_) => false,
            Entry::Many(v) => match v.iter().position(|b| *b == block) {
                Some(i) => {
                    v.remove(i);
                    if let [only] = v[..] {
                        *slot.get_mut() = Entry::One(only);
                    }
                    true
                }
                None => false,
            },
        };
        if removed {
            self.num_blocks -= 1;
        }
        removed
    }

    /// Forgets every registration.
    pub fn clear(&mut self) {
        self.map.clear();
        self.num_blocks = 0;
    }

    /// Every (hash, block) registration, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockHash, u32)> + '_ {
        self.map.iter().flat_map(|(h, e)| {
            let blocks: Vec<u32> = match e {
                Entry::One(b) => vec![*b],
                Entry::Many(v) => v.clone(),
            };
            blocks.into_iter().map(move |b| (h, b))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockHash {
        [i; 32]
    }

    #[test]
    fn single_block_per_key() {
        let mut m = PrefixMap::default();
        m.insert(key(1), 0);
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(!m.pop(&key(1), 7), "a mismatched id leaves the entry");
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(m.pop(&key(1), 0));
        assert_eq!(m.get_one(&key(1)), None);
        assert_eq!(m.num_keys(), 0);
    }

    #[test]
    fn many_blocks_per_key_keep_insertion_order() {
        let mut m = PrefixMap::default();
        m.insert(key(1), 0);
        m.insert(key(1), 3);
        m.insert(key(1), 5);
        assert_eq!(m.get_one(&key(1)), Some(0));
        assert!(m.pop(&key(1), 0));
        assert_eq!(m.get_one(&key(1)), Some(3));
        assert!(m.contains(&key(1), 5));
        assert!(m.pop(&key(1), 3) && m.pop(&key(1), 5));
        assert_eq!(m.num_keys(), 0);
        assert_eq!(m.num_blocks(), 0);
    }
}
