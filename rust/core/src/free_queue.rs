//! The free-block queue: an intrusive doubly-linked list over an index array.
//!
//! Order is eviction order: the head is reused first. Every operation is O(1) per block and
//! allocates nothing. Two sentinel nodes (head and tail) sit after the real blocks so every real
//! node always has both neighbours. A block's two links share one 8-byte node, so linking or
//! unlinking it touches one cache line, not one per link array.

/// Link value of a block that is not in the queue.
const UNLINKED: u32 = u32::MAX;

use crate::error::{try_filled_vec, CoreResult};

/// Free blocks in eviction order.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    nodes: Vec<Node>,
    len: usize,
}

/// A block's links: previous and next block in the queue, or [`UNLINKED`] both.
#[derive(Debug, Clone, Copy)]
struct Node {
    prev: u32,
    next: u32,
}

const NOT_QUEUED: Node = Node {
    prev: UNLINKED,
    next: UNLINKED,
};

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
            nodes: try_filled_vec(num_blocks + 2, NOT_QUEUED, "the free queue")?,
            len: 0,
        };
        q.nodes[head as usize].next = tail;
        q.nodes[tail as usize].prev = head;
        for b in initial {
            q.push_back(b);
        }
        Ok(q)
    }

    fn head(&self) -> u32 {
        (self.nodes.len() - 2) as u32
    }

    fn tail(&self) -> u32 {
        (self.nodes.len() - 1) as u32
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
        self.nodes[block as usize].next != UNLINKED
    }

    /// The block that would be popped first.
    pub fn front(&self) -> Option<u32> {
        let first = self.nodes[self.head() as usize].next;
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
        let last = self.nodes[tail as usize].prev;
        self.link_between(block, last, tail);
    }

    /// Links `block` at the head (reused first).
    pub fn push_front(&mut self, block: u32) {
        let head = self.head();
        let first = self.nodes[head as usize].next;
        self.link_between(block, head, first);
    }

    /// Iterates from head (next to be reused) to tail.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let tail = self.tail();
        let mut cur = self.nodes[self.head() as usize].next;
        std::iter::from_fn(move || {
            if cur == tail {
                return None;
            }
            let b = cur;
            cur = self.nodes[cur as usize].next;
            Some(b)
        })
    }

    fn link_between(&mut self, block: u32, before: u32, after: u32) {
        debug_assert!(
            !self.contains(block),
            "block {block} is already in the free queue"
        );
        self.nodes[block as usize] = Node {
            prev: before,
            next: after,
        };
        self.nodes[before as usize].next = block;
        self.nodes[after as usize].prev = block;
        self.len += 1;
    }

    fn unlink(&mut self, block: u32) {
        let Node { prev, next } = std::mem::replace(&mut self.nodes[block as usize], NOT_QUEUED);
        self.nodes[prev as usize].next = next;
        self.nodes[next as usize].prev = prev;
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
