//! Live requests in a slab: dense `u32` slots for the hot path, an id map for the API, and a
//! generation per slot so a step record never applies to a request that reused a slot.

use hashbrown::HashMap;

use crate::error::{broken, CoreError, CoreResult};
use crate::requests::request::Request;

/// `repr(C)`, on a cache line of its own: the generation and row sit right before the
/// request's hot first fields, so that the slot's lines are the ones [`Request`]'s layout
/// names (a record that straddled lines would cost a step one more miss a request).
#[derive(Debug, Clone, Default)]
#[repr(C, align(64))]
struct Slot {
    generation: u32,
    /// Block-table row while the request is running.
    row: Option<u32>,
    request: Option<Request>,
}

/// Slab of live requests.
#[derive(Debug, Clone, Default)]
pub struct RequestStore {
    slots: Vec<Slot>,
    free_slots: Vec<u32>,
    ids: HashMap<String, u32>,
}

impl RequestStore {
    /// Number of live requests.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether no request is live.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of slots ever allocated (an upper bound on slot indices).
    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Slot of a live request id.
    pub fn slot_of(&self, id: &str) -> Option<u32> {
        self.ids.get(id).copied()
    }

    /// Stores a new request (its id must be unused) and returns its slot.
    pub fn insert(&mut self, request: Request) -> CoreResult<u32> {
        let id = request.spec.request_id.clone();
        if self.ids.contains_key(&id) {
            return Err(CoreError::DuplicateRequest(id));
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot::default());
                (self.slots.len() - 1) as u32
            }
        };
        self.slots[slot as usize].request = Some(request);
        self.ids.insert(id, slot);
        Ok(slot)
    }

    /// Removes a request, bumping its slot's generation.
    pub fn remove(&mut self, slot: u32) -> CoreResult<Request> {
        let s = self
            .slots
            .get_mut(slot as usize)
            .ok_or_else(|| broken!("slot {slot} out of range"))?;
        let request = s
            .request
            .take()
            .ok_or_else(|| broken!("slot {slot} is empty"))?;
        s.generation = s.generation.wrapping_add(1);
        s.row = None;
        self.ids.remove(&request.spec.request_id);
        self.free_slots.push(slot);
        Ok(request)
    }

    /// Generation of a slot if it holds a live request.
    pub fn slot_of_generation(&self, slot: u32) -> Option<u32> {
        let s = self.slots.get(slot as usize)?;
        s.request.as_ref().map(|_| s.generation)
    }

    /// Generation of a slot (changes every time it is freed).
    pub fn generation(&self, slot: u32) -> u32 {
        self.slots
            .get(slot as usize)
            .map_or(u32::MAX, |s| s.generation)
    }

    /// The request in `slot`.
    pub fn get(&self, slot: u32) -> CoreResult<&Request> {
        self.slots
            .get(slot as usize)
            .and_then(|s| s.request.as_ref())
            .ok_or_else(|| broken!("slot {slot} holds no request"))
    }

    /// The request in `slot`, mutably.
    pub fn get_mut(&mut self, slot: u32) -> CoreResult<&mut Request> {
        self.slots
            .get_mut(slot as usize)
            .and_then(|s| s.request.as_mut())
            .ok_or_else(|| broken!("slot {slot} holds no request"))
    }

    /// The request in `slot`, mutably, and its block-table row.
    pub fn get_mut_with_row(&mut self, slot: u32) -> CoreResult<(&mut Request, Option<u32>)> {
        self.slots
            .get_mut(slot as usize)
            .and_then(|s| Some((s.request.as_mut()?, s.row)))
            .ok_or_else(|| broken!("slot {slot} holds no request"))
    }

    /// The request in `slot`, mutably, and the slot's generation.
    pub fn get_mut_with_generation(&mut self, slot: u32) -> CoreResult<(u32, &mut Request)> {
        self.slots
            .get_mut(slot as usize)
            .and_then(|s| Some((s.generation, s.request.as_mut()?)))
            .ok_or_else(|| broken!("slot {slot} holds no request"))
    }

    /// The live request in `slot` if its generation still matches.
    pub fn get_mut_if_current(&mut self, slot: u32, generation: u32) -> Option<&mut Request> {
        let s = self.slots.get_mut(slot as usize)?;
        if s.generation != generation {
            return None;
        }
        s.request.as_mut()
    }

    /// Prefetches the first two lines of the record of the request in `slot` (its state and
    /// counters, its token and block vectors): what reading its counts touches.
    pub fn prefetch_record(&self, slot: u32) {
        if let Some(s) = self.slots.get(slot as usize) {
            let first: *const Slot = s;
            crate::memory::prefetch::read(first);
            crate::memory::prefetch::read(first.cast::<u8>().wrapping_add(64));
        }
    }

    /// Prefetches what applying `num_sampled` tokens reads and appends to for the request in
    /// `slot`: the tail of its tokens, and the tails of its block hashes and block ids only if
    /// those tokens may complete a block (hashed and registered then; a wrong guess costs a miss
    /// later, never a wrong result).
    pub fn prefetch_for_update(&self, slot: u32, num_sampled: usize, block_size: usize) {
        if let Some(r) = self
            .slots
            .get(slot as usize)
            .and_then(|s| s.request.as_ref())
        {
            crate::memory::prefetch::tail(&r.tokens);
            // A block ends at a multiple of `block_size` in (len - 1, len + num_sampled]: its
            // hash is appended when its last token is, and it is registered once the token
            // before that is computed (one step later at most).
            let filled = r.tokens.len() % block_size.max(1);
            if filled == 0 || filled + num_sampled >= block_size {
                crate::memory::prefetch::tail(&r.block_hashes);
                crate::memory::prefetch::tail(&r.blocks.block_ids);
            }
        }
    }

    /// Block-table row of the request in `slot`.
    pub fn row(&self, slot: u32) -> Option<u32> {
        self.slots.get(slot as usize).and_then(|s| s.row)
    }

    /// Records the block-table row of `slot`.
    pub fn set_row(&mut self, slot: u32, row: Option<u32>) {
        if let Some(s) = self.slots.get_mut(slot as usize) {
            s.row = row;
        }
    }

    /// Every live request with its slot.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &Request)> + '_ {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.request.as_ref().map(|r| (i as u32, r)))
    }

    /// Ids of every live request.
    pub fn ids(&self) -> impl Iterator<Item = &str> + '_ {
        self.ids.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::requests::request::RequestSpec;

    fn request(id: &str) -> Request {
        let spec = RequestSpec {
            request_id: id.to_string(),
            prompt_token_ids: vec![1, 2, 3],
            max_tokens: 4,
            ..RequestSpec::default()
        };
        Request::new(spec, 0, None, 64)
    }

    /// The lines of a slot that `Request`'s layout names: what scheduling reads of every
    /// running request, but the drafts' length, lies in the slot's first two lines (the
    /// counters; the token and block vectors), the stop rules that applying its output reads
    /// in the third.
    #[test]
    fn a_steps_fields_lie_in_the_lines_the_layout_names() {
        use crate::requests::kv_view::RequestBlocks;
        use crate::requests::request::StopRules;
        use std::mem::{align_of, offset_of, size_of};
        fn lines(offset: usize, size: usize) -> (usize, usize) {
            (offset / 64, (offset + size - 1) / 64)
        }
        assert_eq!(align_of::<Slot>(), 64);
        assert_eq!(size_of::<Slot>() % 64, 0);
        let request = offset_of!(Slot, request);
        let field = |offset: usize, size: usize| lines(request + offset, size);
        assert_eq!(lines(offset_of!(Slot, generation), 4), (0, 0));
        assert_eq!(
            lines(offset_of!(Slot, row), size_of::<Option<u32>>()),
            (0, 0)
        );
        let counters = offset_of!(Request, status);
        let counters_end = offset_of!(Request, num_prompt_tokens) + size_of::<usize>() - counters;
        assert_eq!(field(counters, counters_end), (0, 0));
        assert_eq!(
            field(offset_of!(Request, num_computed_tokens), size_of::<usize>()),
            (0, 0)
        );
        let blocks = offset_of!(Request, blocks);
        assert_eq!(
            field(offset_of!(Request, tokens), size_of::<Vec<u32>>()),
            (1, 1)
        );
        assert_eq!(
            field(
                blocks + offset_of!(RequestBlocks, block_ids),
                size_of::<Vec<u32>>()
            ),
            (1, 1)
        );
        assert_eq!(
            field(
                blocks + offset_of!(RequestBlocks, num_cached_blocks),
                size_of::<usize>()
            ),
            (1, 1)
        );
        assert_eq!(
            field(offset_of!(Request, stop), size_of::<StopRules>()),
            (2, 2)
        );
    }

    /// A slot's request is found while it is live and never after it was removed: the slot
    /// then reads as empty everywhere, its generation moves on, and a new request reuses it.
    #[test]
    fn a_removed_request_is_gone_from_its_slot() {
        let mut store = RequestStore::default();
        let a = store.insert(request("a")).unwrap();
        let b = store.insert(request("b")).unwrap();
        let generation = store.slot_of_generation(a).unwrap();

        let removed = store.remove(a).unwrap();
        assert_eq!(removed.spec.request_id, "a");
        assert_eq!(removed.tokens, [1, 2, 3]);
        assert!(store.get(a).is_err());
        assert!(store.get_mut(a).is_err());
        assert!(store.get_mut_with_row(a).is_err());
        assert!(store.get_mut_with_generation(a).is_err());
        assert!(store.get_mut_if_current(a, generation).is_none());
        assert_eq!(store.slot_of_generation(a), None);
        assert_ne!(store.generation(a), generation);
        assert_eq!(store.slot_of("a"), None);
        assert!(store.remove(a).is_err(), "a slot is freed once");
        let live: Vec<u32> = store.iter().map(|(slot, _)| slot).collect();
        assert_eq!(live, [b]);
        assert_eq!(store.len(), 1);

        let c = store.insert(request("c")).unwrap();
        assert_eq!(c, a, "the free slot is reused");
        assert_eq!(store.get(c).unwrap().spec.request_id, "c");
        assert_eq!(store.slot_of_generation(c), Some(store.generation(a)));
        assert!(store.get_mut_if_current(c, generation).is_none());
    }
}
