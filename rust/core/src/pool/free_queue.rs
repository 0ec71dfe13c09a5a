//! The free-block queue: blocks in eviction order in a ring of block ids, with holes.
//!
//! Order is eviction order: the head is reused first. Popping reads the ring front to back, so
//! a prefill that takes hundreds of blocks reads consecutive ids, instead of following one
//! cold link per block as a linked list does. Removing a block from the middle (a prefix-cache
//! hit adopting an evictable block) leaves a hole that popping skips; each block's position is
//! kept so removal is O(1). When holes fill the ring, it is compacted in place, which costs
//! O(ring) at most once per `ring - num_blocks` removals. Nothing allocates after creation.

use crate::error::{try_filled_vec, CoreResult};

/// A ring entry left by a removed block.
const HOLE: u32 = u32::MAX;

/// Free blocks in eviction order.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    /// Queued blocks and holes at ring indices `head..tail` (wrapping, `ring.len()` a power of
    /// two of at least twice the blocks).
    ring: Vec<u32>,
    /// Per block: its ring index when it was last queued. Valid while the block is queued: a
    /// block is queued exactly when its entry lies in `head..tail` and still holds it.
    pos: Vec<u32>,
    /// Logical index of the first entry (wrapping; the ring index is `head & mask`).
    head: usize,
    /// Logical index one past the last entry.
    tail: usize,
    /// Queued blocks (entries that are not holes).
    len: usize,
}

impl FreeQueue {
    /// A queue over block ids `0..num_blocks`, holding `initial` in the given order.
    pub fn new(num_blocks: usize, initial: impl IntoIterator<Item = u32>) -> Self {
        Self::try_new(num_blocks, initial).expect("out of memory for the free queue")
    }

    /// Bytes [`Self::try_new`] allocates for `num_blocks` blocks.
    pub fn bytes_for(num_blocks: usize) -> u128 {
        let n = num_blocks as u128;
        let ring = (2 * n).max(2).next_power_of_two();
        (ring + n) * std::mem::size_of::<u32>() as u128
    }

    /// Like [`Self::new`], but reports an allocation failure instead of aborting.
    pub fn try_new(num_blocks: usize, initial: impl IntoIterator<Item = u32>) -> CoreResult<Self> {
        let capacity = (2 * num_blocks).max(2).next_power_of_two();
        let mut q = Self {
            ring: try_filled_vec(capacity, HOLE, "the free queue")?,
            pos: try_filled_vec(num_blocks, 0, "the free queue's positions")?,
            head: 0,
            tail: 0,
            len: 0,
        };
        for b in initial {
            q.push_back(b);
        }
        Ok(q)
    }

    fn mask(&self) -> usize {
        self.ring.len() - 1
    }

    /// Number of blocks in the queue.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the queue is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `block` is in the queue.
    pub fn contains(&self, block: u32) -> bool {
        let Some(&at) = self.pos.get(block as usize) else {
            return false;
        };
        let at = at as usize;
        let offset = at.wrapping_sub(self.head) & self.mask();
        offset < self.tail.wrapping_sub(self.head) && self.ring[at] == block
    }

    /// The block that would be popped first.
    pub fn front(&self) -> Option<u32> {
        self.iter().next()
    }

    /// The entries at `offset..offset + n` past the head, holes skipped (they may be fewer than
    /// `n`, and the range may reach past the tail, where nothing is queued).
    pub fn entries_ahead(&self, offset: usize, n: usize) -> impl Iterator<Item = u32> + '_ {
        let queued = self.tail.wrapping_sub(self.head);
        let mask = self.mask();
        (offset..offset.saturating_add(n).min(queued))
            .map(move |i| self.ring[self.head.wrapping_add(i) & mask])
            .filter(|&b| b != HOLE)
    }

    /// Detaches and returns the head block.
    pub fn pop_front(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        let mask = self.mask();
        loop {
            // `len > 0`, so a queued block lies before `tail`.
            let b = self.ring[self.head & mask];
            self.head = self.head.wrapping_add(1);
            if b != HOLE {
                self.len -= 1;
                if self.len == 0 {
                    self.head = self.tail; // drop the holes behind it
                }
                return Some(b);
            }
        }
    }

    /// Unlinks `block` from anywhere in the queue. The caller guarantees it is queued.
    pub fn remove(&mut self, block: u32) {
        debug_assert!(
            self.contains(block),
            "block {block} is not in the free queue"
        );
        let at = self.pos[block as usize] as usize;
        self.ring[at] = HOLE;
        self.len -= 1;
    }

    /// Queues `block` at the tail (reused last).
    pub fn push_back(&mut self, block: u32) {
        debug_assert!(
            !self.contains(block),
            "block {block} is already in the free queue"
        );
        self.make_room();
        let at = self.tail & self.mask();
        self.ring[at] = block;
        self.pos[block as usize] = at as u32;
        self.tail = self.tail.wrapping_add(1);
        self.len += 1;
    }

    /// Queues `block` at the head (reused first).
    pub fn push_front(&mut self, block: u32) {
        debug_assert!(
            !self.contains(block),
            "block {block} is already in the free queue"
        );
        self.make_room();
        self.head = self.head.wrapping_sub(1);
        let at = self.head & self.mask();
        self.ring[at] = block;
        self.pos[block as usize] = at as u32;
        self.len += 1;
    }

    /// Iterates from head (next to be reused) to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.entries_ahead(0, usize::MAX)
    }

    /// Compacts the entries when the ring is full (of holes: it has room for every block
    /// twice), keeping their order.
    fn make_room(&mut self) {
        if self.tail.wrapping_sub(self.head) < self.ring.len() {
            return;
        }
        let mask = self.mask();
        let mut write = self.head;
        let mut read = self.head;
        while read != self.tail {
            let b = self.ring[read & mask];
            read = read.wrapping_add(1);
            if b != HOLE {
                let at = write & mask;
                self.ring[at] = b;
                self.pos[b as usize] = at as u32;
                write = write.wrapping_add(1);
            }
        }
        self.tail = write;
        debug_assert_eq!(self.tail.wrapping_sub(self.head), self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn pop_remove_append_keep_order() {
        let mut q = FreeQueue::new(5, 0..5);
        assert_eq!(q.pop_front(), Some(0));
        q.remove(2);
        assert_eq!(items(&q), [1, 3, 4]);
        q.push_back(2);
        assert_eq!(items(&q), [1, 3, 4, 2]);
        while q.pop_front().is_some() {}
        assert!(q.is_empty());
        assert_eq!(q.pop_front(), None);
    }

    #[test]
    fn entries_ahead_skip_holes_and_stop_at_the_tail() {
        let mut q = FreeQueue::new(8, 0..6);
        q.remove(3);
        let ahead = |q: &FreeQueue, offset, n| q.entries_ahead(offset, n).collect::<Vec<_>>();
        assert_eq!(ahead(&q, 0, 2), [0, 1]);
        assert_eq!(ahead(&q, 2, 3), [2, 4]); // entry 3 is a hole
        assert_eq!(ahead(&q, 4, 10), [4, 5]); // nothing past the tail
        assert_eq!(ahead(&q, 9, 2), Vec::<u32>::new());
        q.pop_front();
        assert_eq!(ahead(&q, 0, 1), [1]);
    }

    #[test]
    fn push_front_goes_first() {
        let mut q = FreeQueue::new(6, [0, 3]);
        q.push_front(2);
        q.push_front(1);
        assert_eq!(items(&q), [1, 2, 0, 3]);
        assert_eq!(q.len(), 4);
    }

    #[test]
    fn initial_order_is_kept() {
        let mut q = FreeQueue::new(6, [1, 3, 5, 4, 0, 2]);
        let popped: Vec<u32> = std::iter::from_fn(|| q.pop_front()).collect();
        assert_eq!(popped, [1, 3, 5, 4, 0, 2]);
        assert!((0..6).all(|b| !q.contains(b)));
    }

    #[test]
    fn holes_are_compacted_in_order() {
        // 4 blocks in a ring of 8: removing and re-adding from the middle fills it with holes.
        let mut q = FreeQueue::new(4, 0..4);
        for round in 0..50 {
            let b = [1, 2][round % 2];
            q.remove(b);
            q.push_back(b);
            assert_eq!(q.len(), 4);
            assert!((0..4).all(|b| q.contains(b)));
        }
        assert_eq!(items(&q), [0, 3, 1, 2]);
        q.remove(2);
        q.push_front(2);
        assert_eq!(items(&q), [2, 0, 3, 1]);
        let popped: Vec<u32> = std::iter::from_fn(|| q.pop_front()).collect();
        assert_eq!(popped, [2, 0, 3, 1]);
        assert!((0..4).all(|b| !q.contains(b)));
    }

    #[test]
    fn stale_positions_do_not_count_as_queued() {
        // Block 0 popped, block 1 later reuses its ring entry: 0 must not look queued.
        let mut q = FreeQueue::new(2, [0]);
        assert_eq!(q.pop_front(), Some(0));
        q.push_front(1);
        assert!(q.contains(1));
        assert!(!q.contains(0));
    }
}
