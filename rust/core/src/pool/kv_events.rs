//! KV-cache events: the prefix-cache changes a KV-aware router follows (vLLM's `BlockStored`,
//! `BlockRemoved` and `AllBlocksCleared`).
//!
//! The log exists only when events are enabled ([`crate::SchedulerConfig::kv_events`]); without
//! it the pool pays one branch per call that could emit. Events are recorded where vLLM's block
//! pool emits them: one `Stored` per registration call (the blocks a request's allocation or
//! output made full), one `Removed` per registered block whose hash is evicted (a cached free
//! block popped for reuse, or a registration withdrawn), one `Cleared` per successful prefix
//! cache reset. The engine drains them each step ([`KvEventLog::take`]) and turns block ids into
//! its own hashes: the log carries block ids and tokens, not the core's hashes, which are not
//! the engine's.

use std::mem;

/// One prefix-cache change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `blocks` were registered as logical blocks `first..first + blocks.len()` of
    /// `request_id`, whose block `first - 1` is `parent` (`NULL_BLOCK` when `first == 0`);
    /// `tokens` are the tokens they hold (`blocks.len() * block_size`), followed by the tokens
    /// after the last block that its hash also covers
    /// ([`crate::SchedulerConfig::hash_lookahead_tokens`]).
    Stored {
        /// The request whose tokens the blocks hold.
        request_id: String,
        /// Logical index of the first block.
        first: usize,
        /// The request's block before the first one (`NULL_BLOCK` if none).
        parent: u32,
        /// The blocks, in logical order.
        blocks: Vec<u32>,
        /// Their tokens.
        tokens: Vec<u32>,
    },
    /// `block`'s registration was evicted (it is reused, or its KV was never computed).
    Removed {
        /// The block whose hash left the prefix cache.
        block: u32,
    },
    /// The prefix cache was emptied.
    Cleared,
}

/// Events recorded since the last [`Self::take`].
#[derive(Debug, Clone, Default)]
pub struct KvEventLog {
    events: Vec<KvEvent>,
    /// Events before this index are attributed to their request.
    attributed: usize,
}

impl KvEventLog {
    /// Records blocks registered for a request not named yet: [`Self::attribute`] names it.
    pub fn stored(&mut self, first: usize, parent: u32, blocks: &[u32], tokens: &[u32]) {
        self.events.push(KvEvent::Stored {
            request_id: String::new(),
            first,
            parent,
            blocks: blocks.to_vec(),
            tokens: tokens.to_vec(),
        });
    }

    /// Records that `block`'s registration was evicted.
    pub fn removed(&mut self, block: u32) {
        self.events.push(KvEvent::Removed { block });
    }

    /// Records that the prefix cache was emptied.
    pub fn cleared(&mut self) {
        self.events.push(KvEvent::Cleared);
    }

    /// Names `request_id` as the request of every `Stored` event recorded since the last call.
    pub fn attribute(&mut self, request_id: &str) {
        for e in &mut self.events[self.attributed..] {
            if let KvEvent::Stored { request_id: id, .. } = e {
                id.push_str(request_id);
            }
        }
        self.attributed = self.events.len();
    }

    /// Events recorded so far.
    pub fn events(&self) -> &[KvEvent] {
        &self.events
    }

    /// Takes every event recorded so far, oldest first.
    pub fn take(&mut self) -> Vec<KvEvent> {
        self.attributed = 0;
        mem::take(&mut self.events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attribute_names_only_the_unnamed_stores() {
        let mut log = KvEventLog::default();
        log.stored(0, 0, &[3], &[1, 2]);
        log.removed(4);
        log.attribute("a");
        log.stored(1, 3, &[5], &[3, 4]);
        log.attribute("b");
        log.cleared();
        let events = log.take();
        assert_eq!(events.len(), 4);
        assert!(matches!(&events[0], KvEvent::Stored { request_id, .. } if request_id == "a"));
        assert_eq!(events[1], KvEvent::Removed { block: 4 });
        assert!(
            matches!(&events[2], KvEvent::Stored { request_id, first: 1, parent: 3, .. }
            if request_id == "b")
        );
        assert_eq!(events[3], KvEvent::Cleared);
        assert!(log.take().is_empty());
    }
}
