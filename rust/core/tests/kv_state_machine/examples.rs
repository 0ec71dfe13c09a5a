//! Pinned examples: the worked arithmetic of the spec (§2.9).

use super::*;

pub(crate) fn allocate(
    mgr: &mut KvCacheManager,
    req: &mut RequestBlocks,
    content: &Content,
    args: AllocateArgs<'_>,
) -> Option<usize> {
    mgr.allocate_slots(req, content.view(), args)
        .expect("valid arguments")
}

pub(crate) fn hashed(tokens: Vec<u32>, block_size: usize) -> Content {
    let mut content = Content {
        lora: None,
        salt: None,
        extra: ExtraKeys::default(),
        tokens,
        hashes: Vec::new(),
    };
    let hasher = BlockHasher::new(HashAlgo::Sha256, block_size, b"pinned");
    let extra = content.extra_keys();
    hasher.extend_hashes(&mut content.hashes, &content.tokens, &extra);
    content
}

#[test]
fn worked_allocation_arithmetic() {
    let mut mgr = KvCacheManager::new(32, 16, 1024, true).unwrap();
    // 55-token prompt, cold: 4 blocks, 3 cached.
    let mut a = hashed((0..55).collect(), 16);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (4, 3));
    // + 4 decode tokens (59 known): no new block, still 3 cached.
    a = hashed((0..59).collect(), 16);
    let args = AllocateArgs {
        num_new_tokens: 4,
        num_computed_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(4));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (4, 3));
    // + 19 tokens (78 known): 5 blocks, 4 cached.
    a = hashed((0..78).collect(), 16);
    let args = AllocateArgs {
        num_new_tokens: 19,
        num_computed_tokens: 59,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(4));
    assert_eq!((req_a.block_ids.len(), req_a.num_cached_blocks), (5, 4));
    // 53-token prompt sharing 48: 3 hits + 1 new block.
    let b = hashed((0..48).chain(900..905).collect(), 16);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 48);
    assert_eq!(hits, req_a.block_ids[..3]);
    let mut req_b = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 5,
        num_new_computed_tokens: 48,
        new_computed_blocks: &hits,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, args), Some(3));
    assert_eq!(req_b.block_ids.len(), 4);
    // DFlash K=3, 16-token prompt, first prefill with K+1 lookahead: 2 blocks, 1 cached.
    let c = hashed((2000..2016).collect(), 16);
    let mut req_c = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 16,
        num_lookahead_tokens: 4,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_c, &c, args), Some(0));
    assert_eq!((req_c.block_ids.len(), req_c.num_cached_blocks), (2, 1));
    mgr.check_invariants([&req_a, &req_b, &req_c]).unwrap();

    // test_allocate_with_lookahead: block 4, 3 new tokens, lookahead 2 or 4 -> 2 blocks.
    for lookahead in [2, 4] {
        let mut mgr = KvCacheManager::new(11, 4, 1024, true).unwrap();
        let d = hashed(vec![1, 2, 3], 4);
        let mut req = RequestBlocks::default();
        let args = AllocateArgs {
            num_new_tokens: 3,
            num_lookahead_tokens: lookahead,
            ..Default::default()
        };
        assert_eq!(allocate(&mut mgr, &mut req, &d, args), Some(0));
        assert_eq!(req.block_ids.len(), 2);
    }
}

/// test_evictable_cached_blocks_not_double_allocated: adopting free cached hits costs capacity.
#[test]
fn evictable_hits_count_against_capacity() {
    let mut mgr = KvCacheManager::new(5, 2, 1024, true).unwrap(); // 4 usable blocks
    let a = hashed(vec![1, 2, 3, 4, 5], 2);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 5,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    mgr.free(&mut req_a); // 3 blocks, 2 of them cached and evictable; 4 free in all
    let b = hashed(vec![1, 2, 3, 4, 9, 9, 9, 9], 2);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 4);
    // 8 tokens = 4 blocks: 2 adopted (free, so they cost 2) + 2 new = 4 <= 4 free: fits...
    let mut req_b = RequestBlocks::default();
    let fits = AllocateArgs {
        num_new_tokens: 4,
        num_new_computed_tokens: 4,
        new_computed_blocks: &hits,
        ..Default::default()
    };
    let snapshot = mgr.clone();
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, fits), Some(2));
    // ...but one lookahead slot more needs a 5th block, and nothing may change.
    let mut mgr = snapshot;
    let mut req_b = RequestBlocks::default();
    let too_big = AllocateArgs {
        num_lookahead_tokens: 1,
        ..fits
    };
    assert_eq!(allocate(&mut mgr, &mut req_b, &b, too_big), None);
    assert_eq!(req_b, RequestBlocks::default());
    assert_eq!(mgr.num_free_blocks(), 4);
    mgr.check_invariants([&req_b]).unwrap();
}

#[test]
fn the_eagle_block_drop_gives_back_the_last_hit_block() {
    let mut mgr = KvCacheManager::new(32, 16, 1024, true).unwrap();
    let a = hashed((0..55).collect(), 16);
    let mut req_a = RequestBlocks::default();
    let args = AllocateArgs {
        num_new_tokens: 55,
        ..Default::default()
    };
    assert_eq!(allocate(&mut mgr, &mut req_a, &a, args), Some(0));
    let b = hashed((0..48).chain(900..905).collect(), 16);
    let mut hits = Vec::new();
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 48);
    mgr.set_drop_last_hit_block(true);
    assert_eq!(mgr.get_computed_blocks(b.view(), &mut hits), 32);
    assert_eq!(hits, req_a.block_ids[..2]);
    // A one-block hit drops to none.
    let c = hashed((0..16).chain(700..710).collect(), 16);
    assert_eq!(mgr.get_computed_blocks(c.view(), &mut hits), 0);
    assert!(hits.is_empty());
}
