//! The free-block queue: an intrusive doubly-linked list over index arrays.
//!
//! Order is eviction order: the head is reused first. Every operation is O(1) per block and
//! allocates nothing. Two sentinel nodes (head and tail) sit after the real blocks so every real
//! node always has both neighbours.

/// Link value of a block that is not in the queue.
const UNLINKED: u32 = u32::MAX;

use crate::error::{try_filled_vec, CoreResult};

/// Free blocks in eviction order.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    len: usize,
}

impl FreeQueue {
    /// A queue over block ids `0..num_blocks`, holding `initial` in the given order.
    pub fn new(num_blocks: usize, initial: impl IntoIterator<Item = u32>) -> Self {
        Self::try_new(num_blocks, initial).expect("out of memory for the free queue")
    }

    /// Like [`Self::new`], but reports an allocation failure instead of aborting.
    pub fn try_new(num_blocks: usize, initial: impl IntoIterator<Item = u32>) -> CoreResult<Self> {
        let head = num_blocks as u32;
        let tail = head + 1;
        let mut q = Self {
            prev: try_filled_vec(num_blocks + 2, UNLINKED, "the free queue")?,
            next: try_filled_vec(num_blocks + 2, UNLINKED, "the free queue")?,
            len: 0,
        };
        q.next[head as usize] = tail;
        q.prev[tail as usize] = head;
        for b in initial {
            q.push_back(b);
        }
        Ok(q)
    }

    fn head(&self) -> u32 {
        (self.prev.len() - 2) as u32
    }

    fn tail(&self) -> u32 {
        (self.prev.len() - 1) as u32
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
        self.next[block as usize] != UNLINKED
    }

    /// The block that would be popped first.
    pub fn front(&self) -> Option<u32> {
        let first = self.next[self.head() as usize];
        (first != self.tail()).then_some(first)
    }

    /// Detaches and returns the head block.
    pub fn pop_front(&mut self) -> Option<u32> {
        let first = self.front()?;
        self.unlink(first);
        Some(first)
    }

    /// Unlinks `block` from anywhere in the queue. The caller guarantees it is linked.
    pub fn remove(&mut self, block: u32) {
        debug_assert!(
            self.contains(block),
            "block {block} is not in the free queue"
        );
        self.unlink(block);
    }

    /// Links `block` at the tail (reused last).
    pub fn push_back(&mut self, block: u32) {
        let tail = self.tail();
        let last = self.prev[tail as usize];
        self.link_between(block, last, tail);
    }

    /// Links `block` at the head (reused first).
    pub fn push_front(&mut self, block: u32) {
        let head = self.head();
        let first = self.next[head as usize];
        self.link_between(block, head, first);
    }

    /// Iterates from head (next to be reused) to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let tail = self.tail();
        let mut cur = self.next[self.head() as usize];
        std::iter::from_fn(move || {
            if cur == tail {
                return None;
            }
            let b = cur;
            cur = self.next[cur as usize];
            Some(b)
        })
    }

    fn link_between(&mut self, block: u32, before: u32, after: u32) {
        debug_assert!(
            !self.contains(block),
            "block {block} is already in the free queue"
        );
        self.prev[block as usize] = before;
        self.next[block as usize] = after;
        self.next[before as usize] = block;
        self.prev[after as usize] = block;
        self.len += 1;
    }

    fn unlink(&mut self, block: u32) {
        let (p, n) = (self.prev[block as usize], self.next[block as usize]);
        self.next[p as usize] = n;
        self.prev[n as usize] = p;
        self.prev[block as usize] = UNLINKED;
        self.next[block as usize] = UNLINKED;
        self.len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn pop_remove_append_keep_links() {
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
}
