//! The waiting queue: FCFS (preempted requests go back to the front) or priority (lowest
//! priority value first, then earliest arrival, then submission order).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};

use crate::error::{invalid, CoreResult};

/// Scheduling policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Policy {
    /// First come, first served.
    #[default]
    Fcfs,
    /// By priority value (lower first), then arrival time.
    Priority,
}

impl Policy {
    /// Parses "fcfs" or "priority".
    pub fn from_name(name: &str) -> CoreResult<Self> {
        match name {
            "fcfs" => Ok(Self::Fcfs),
            "priority" => Ok(Self::Priority),
            other => Err(invalid!(
                "unknown policy {other:?}; expected \"fcfs\" or \"priority\""
            )),
        }
    }

    /// The canonical name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Fcfs => "fcfs",
            Self::Priority => "priority",
        }
    }
}

/// Ordering key of a request in the priority queue.
#[derive(Debug, Clone, Copy)]
pub struct PriorityKey {
    /// Lower is served first.
    pub priority: i64,
    /// Earlier is served first.
    pub arrival_time: f64,
    /// Submission order breaks the remaining ties.
    pub arrival_seq: u64,
}

impl PriorityKey {
    /// Total order: smaller key = served first (and preempted last).
    pub fn cmp_key(&self, other: &Self) -> Ordering {
        self.priority
            .cmp(&other.priority)
            .then(self.arrival_time.total_cmp(&other.arrival_time))
            .then(self.arrival_seq.cmp(&other.arrival_seq))
    }
}

#[derive(Debug, Clone, Copy)]
struct HeapEntry {
    key: PriorityKey,
    handle: u32,
}

impl PartialEq for HeapEntry {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for HeapEntry {}
impl PartialOrd for HeapEntry {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for HeapEntry {
    // BinaryHeap pops the max, so invert: the smallest key is the "largest" entry.
    fn cmp(&self, other: &Self) -> Ordering {
        other.key.cmp_key(&self.key)
    }
}

/// Waiting requests, by request handle.
#[derive(Debug, Clone)]
pub struct WaitingQueue(Inner);

#[derive(Debug, Clone)]
enum Inner {
    Fcfs(VecDeque<u32>),
    Priority(BinaryHeap<HeapEntry>),
}

impl WaitingQueue {
    /// An empty queue for `policy`.
    pub fn new(policy: Policy) -> Self {
        Self(match policy {
            Policy::Fcfs => Inner::Fcfs(VecDeque::new()),
            Policy::Priority => Inner::Priority(BinaryHeap::new()),
        })
    }

    /// Number of waiting requests.
    pub fn len(&self) -> usize {
        match &self.0 {
            Inner::Fcfs(q) => q.len(),
            Inner::Priority(h) => h.len(),
        }
    }

    /// Adds a newly arrived request.
    pub fn push_back(&mut self, handle: u32, key: PriorityKey) {
        match &mut self.0 {
            Inner::Fcfs(q) => q.push_back(handle),
            Inner::Priority(h) => h.push(HeapEntry { key, handle }),
        }
    }

    /// Returns a preempted request: to the front under FCFS, by key under priority.
    pub fn push_front(&mut self, handle: u32, key: PriorityKey) {
        match &mut self.0 {
            Inner::Fcfs(q) => q.push_front(handle),
            Inner::Priority(h) => h.push(HeapEntry { key, handle }),
        }
    }

    /// The request to admit next.
    pub fn peek(&self) -> Option<u32> {
        match &self.0 {
            Inner::Fcfs(q) => q.front().copied(),
            Inner::Priority(h) => h.peek().map(|e| e.handle),
        }
    }

    /// Removes and returns the request to admit next.
    pub fn pop(&mut self) -> Option<u32> {
        match &mut self.0 {
            Inner::Fcfs(q) => q.pop_front(),
            Inner::Priority(h) => h.pop().map(|e| e.handle),
        }
    }

    /// Removes `handle` wherever it is (abort); returns whether it was there. O(n).
    pub fn remove(&mut self, handle: u32) -> bool {
        match &mut self.0 {
            Inner::Fcfs(q) => match q.iter().position(|&x| x == handle) {
                Some(i) => {
                    q.remove(i);
                    true
                }
                None => false,
            },
            Inner::Priority(h) => {
                let before = h.len();
                h.retain(|e| e.handle != handle);
                h.len() != before
            }
        }
    }

    /// Handles in admission order.
    pub fn handles_in_order(&self) -> Vec<u32> {
        match &self.0 {
            Inner::Fcfs(q) => q.iter().copied().collect(),
            Inner::Priority(h) => {
                let mut v: Vec<HeapEntry> = h.iter().copied().collect();
                v.sort_by(|a, b| a.key.cmp_key(&b.key));
                v.into_iter().map(|e| e.handle).collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(priority: i64, arrival_time: f64, arrival_seq: u64) -> PriorityKey {
        PriorityKey {
            priority,
            arrival_time,
            arrival_seq,
        }
    }

    #[test]
    fn fcfs_front_for_preempted() {
        let mut q = WaitingQueue::new(Policy::Fcfs);
        q.push_back(1, key(0, 0.0, 0));
        q.push_back(2, key(0, 0.0, 1));
        q.push_front(3, key(0, 0.0, 2));
        assert_eq!(q.handles_in_order(), [3, 1, 2]);
        assert!(q.remove(1));
        assert_eq!(q.pop(), Some(3));
    }

    #[test]
    fn priority_then_arrival_then_seq() {
        let mut q = WaitingQueue::new(Policy::Priority);
        q.push_back(10, key(1, 0.0, 0));
        q.push_back(11, key(0, 5.0, 1));
        q.push_back(12, key(0, 1.0, 2));
        q.push_back(13, key(0, 1.0, 3));
        assert_eq!(q.handles_in_order(), [12, 13, 11, 10]);
        assert_eq!(q.pop(), Some(12));
        assert_eq!(q.peek(), Some(13));
    }
}
