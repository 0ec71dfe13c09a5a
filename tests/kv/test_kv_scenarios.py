"""Full-attention KV-cache scenarios, ported from vLLM's own tests with their numbers.

Sources (vLLM's test files): tests/v1/core/test_kv_cache_utils.py,
tests/v1/core/test_prefix_caching.py, tests/v1/core/test_single_type_kv_cache_manager.py, plus
the worked allocation arithmetic of vLLM's KV-cache manager.

Adaptation to our API: vLLM's ``request.num_computed_tokens`` is our ``num_computed_tokens``;
``get_computed_blocks`` returns ``(hit block ids, hit tokens)``; ``allocate_slots`` returns the
newly allocated block ids (or None).  ``make_kv_cache_config(16, 11)`` is
``KVCacheManager(11, 16, ...)``: block 0 is the null block, so 10 blocks are usable.

Free order is vLLM 0.33's (``BlockPool.free_blocks``): a request's blocks are released tail
first; those registered in the prefix cache are appended to the free queue (evicted last, LRU),
those without a hash (partial blocks; every block when caching is off) are prepended (reused
first).  The reference doc's 5.2 numbers are vLLM 0.23's, which appended both; every free-order
number below was re-checked against vLLM 0.33.0 itself (``pip install vllm==0.33.0``).
"""

from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

import dflash_rs
from dflash_rs import KVCacheManager

from .kv_model import snapshot

HASH_ALGOS = ["sha256", "blake3", "xxh3_128"]
COMMON = [i for i in range(3) for _ in range(16)]  # 3 complete blocks of 16 (48 tokens)


def admit(
    m: KVCacheManager,
    rid: str,
    tokens: Sequence[int],
    *,
    num_new_tokens: Optional[int] = None,
    lookahead: int = 0,
    lora_name: Optional[str] = None,
    cache_salt: Optional[str] = None,
) -> Tuple[List[int], int, Optional[List[int]]]:
    """add_request + get_computed_blocks + allocate_slots, the way a scheduler admits a request."""
    m.add_request(rid, tokens, lora_name=lora_name, cache_salt=cache_salt)
    hits, num_hit = m.get_computed_blocks(rid)
    if num_new_tokens is None:
        num_new_tokens = len(tokens) - num_hit
    new = m.allocate_slots(
        rid,
        num_new_tokens,
        num_computed_tokens=0,
        num_new_computed_tokens=num_hit,
        new_computed_blocks=hits,
        num_lookahead_tokens=lookahead,
    )
    m.check_invariants()
    return hits, num_hit, new


# ---------------------------------------------------------------- 5.2 test_prefix_caching.py


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)
def test_prefill(hash_algo: str) -> None:
    m = KVCacheManager(11, 16, 8192, hash_algo=hash_algo)
    assert m.num_free_blocks == 10 and m.free_block_ids() == list(range(1, 11))

    # Fully cache miss: 3 complete blocks + an incomplete one of 7 tokens.
    req0 = [*COMMON, *[3] * 7]
    m.add_request("0", req0)
    assert len(m.block_hashes("0")) == 3
    assert m.get_computed_blocks("0") == ([], 0)
    assert m.allocate_slots("0", 55, num_computed_tokens=0) == [1, 2, 3, 4]
    m.check_invariants()
    # Full blocks carry the request's chained hashes; the partial block carries none.
    hashes0 = m.block_hashes("0")
    assert [m.block_hash(b) for b in (1, 2, 3)] == hashes0
    assert len(set(hashes0)) == 3
    assert m.block_hash(4) is None
    assert [m.ref_count(b) for b in (1, 2, 3, 4)] == [1, 1, 1, 1]
    assert m.num_cached_blocks("0") == 3
    assert m.num_prefix_cached_blocks == 3

    # Cache hit in the common prefix while the original blocks are still in use.
    m.add_request("1", [*COMMON, *[3] * 5])
    assert m.block_hashes("1") == hashes0
    hits, num_hit = m.get_computed_blocks("1")
    assert (hits, num_hit) == ([1, 2, 3], 48)
    new = m.allocate_slots(
        "1", 53 - 48, num_computed_tokens=0, num_new_computed_tokens=48, new_computed_blocks=hits
    )
    assert new == [5]
    assert m.block_ids("1") == [1, 2, 3, 5]
    assert [m.ref_count(b) for b in (1, 2, 3)] == [2, 2, 2]
    assert m.num_free_blocks == 5
    m.check_invariants()

    m.free("0")
    m.free("1")
    assert m.num_free_blocks == 10
    # [partial blocks without a hash, prepended for immediate reuse: req1's 5, req0's 4]
    # [never used: 6..10] [cached, tail first, evicted last: 3, 2, 1 (ref 0 once req1 is freed)]
    # (vLLM 0.23, which appended every block, gave [6, 7, 8, 9, 10, 4, 5, 3, 2, 1].)
    assert m.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    m.check_invariants()

    # Cache hit in the common prefix when the original blocks are already free.
    m.add_request("2", [*COMMON, *[3] * 6])
    hits, num_hit = m.get_computed_blocks("2")
    assert (hits, num_hit) == ([1, 2, 3], 48)
    new = m.allocate_slots(
        "2", 54 - 48, num_computed_tokens=0, num_new_computed_tokens=48, new_computed_blocks=hits
    )
    assert new == [5]  # reuses the partial block 5
    assert m.num_free_blocks == 6
    assert all(m.ref_count(b) == 0 for b in m.free_block_ids())
    assert m.free_block_ids() == [4, 6, 7, 8, 9, 10]
    m.free("2")
    assert m.free_block_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Cache miss and eviction: the allocation order is the eviction order.
    m.add_request("3", [99] * (16 * 10))
    assert m.get_computed_blocks("3") == ([], 0)
    assert m.allocate_slots("3", 160, num_computed_tokens=0) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert m.num_free_blocks == 0 and m.free_block_ids() == []
    # The evicted blocks lost their old registration and now carry req3's hashes.
    assert [m.block_hash(b) for b in m.block_ids("3")] == m.block_hashes("3")
    assert m.num_prefix_cached_blocks == 10
    assert not set(hashes0) & {m.block_hash(b) for b in range(1, 11)}
    assert m.usage == 1.0
    # Lookups: 4 requests, 55 + 53 + 54 + 160 tokens queried, 48 + 48 tokens hit.
    assert m.prefix_cache_stats() == (4, 322, 96)
    m.check_invariants()


def test_decode() -> None:
    m = KVCacheManager(11, 16, 8192)
    assert admit(m, "0", [*COMMON, *[3] * 7]) == ([], 0, [1, 2, 3, 4])

    # 4 decode tokens fit in the partial last block: no new block, the tail stays unhashed.
    m.append_token_ids("0", [8] * 4)
    assert m.num_tokens("0") == 59
    assert m.allocate_slots("0", 4, num_computed_tokens=55) == []
    assert m.block_ids("0") == [1, 2, 3, 4]
    assert m.block_hash(4) is None
    assert m.num_cached_blocks("0") == 3

    # 9 tokens fill the previous block and 10 go into one new block.
    m.append_token_ids("0", [7] * 19)
    assert m.num_tokens("0") == 78
    new = m.allocate_slots("0", 19, num_computed_tokens=59)
    assert new is not None and len(new) == 1 and new == [5]
    assert m.block_ids("0") == [1, 2, 3, 4, 5]
    assert m.block_hash(4) is not None and m.block_hash(4) == m.block_hashes("0")[3]
    assert m.block_hash(5) is None
    assert m.num_cached_blocks("0") == 4
    m.check_invariants()


def test_evict() -> None:
    m = KVCacheManager(11, 16, 8192)
    last_token_id = 5 * 16 + 7
    _, _, new = admit(m, "0", list(range(last_token_id)))
    assert new == [1, 2, 3, 4, 5, 6]  # 5 full + 1 partial
    _, _, new = admit(m, "1", list(range(last_token_id, last_token_id + 3 * 16)))
    assert new == [7, 8, 9]  # 3 full blocks
    assert m.num_free_blocks == 1  # 10 - (6 + 3)

    m.free("0")
    # Partial block (no hash) at the head, cached ones at the tail (LRU).
    assert m.free_block_ids() == [6, 10, 5, 4, 3, 2, 1]
    m.free("1")
    assert m.num_free_blocks == 10
    assert m.free_block_ids() == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]

    # Touch the first 2 blocks.
    m.add_request("2", list(range(2 * 16 + 3)))
    hits, num_hit = m.get_computed_blocks("2")
    assert (hits, num_hit) == ([1, 2], 32)
    new = m.allocate_slots(
        "2", 3, num_computed_tokens=0, num_new_computed_tokens=32, new_computed_blocks=hits
    )
    assert new == [6]
    assert m.num_free_blocks == 7
    assert m.free_block_ids() == [10, 5, 4, 3, 9, 8, 7]
    m.check_invariants()


def test_hash_block_correct_reuse() -> None:
    """A freed cached block reused as a new (partial) block loses its old hash."""
    m = KVCacheManager(2, 16, 8192)  # one usable block
    assert admit(m, "0", list(range(16))) == ([], 0, [1])
    assert m.block_hash(1) == m.block_hashes("0")[0]
    m.free("0")
    assert m.block_hash(1) is not None  # kept as an eviction candidate
    assert m.num_prefix_cached_blocks == 1

    assert admit(m, "1", list(range(15))) == ([], 0, [1])
    assert m.block_hash(1) is None
    assert m.num_prefix_cached_blocks == 0
    assert m.num_cached_blocks("1") == 0
    m.check_invariants()


def test_computed_blocks_not_evicted() -> None:
    """A hit on a free block is touched (leaves the free queue) before new blocks are popped."""
    m = KVCacheManager(3, 16, 8192)  # two usable blocks
    assert admit(m, "0", list(range(16))) == ([], 0, [1])
    assert admit(m, "1", list(range(16, 32))) == ([], 0, [2])
    m.free("0")
    m.free("1")
    assert m.free_block_ids() == [1, 2]

    # Block 1 is at the head of the free queue, but it is the hit: block 2 must be evicted.
    hits, num_hit, new = admit(m, "2", list(range(32)))
    assert (hits, num_hit) == ([1], 16)
    assert new == [2]
    assert m.block_ids("2") == [1, 2]
    assert m.num_free_blocks == 0
    # Block 2 lost req1's hash and now holds req2's second block.
    assert m.block_hash(2) == m.block_hashes("2")[1]


def test_basic_prefix_caching_disabled() -> None:
    m = KVCacheManager(5, 4, 8192, enable_prefix_caching=False)
    assert not m.enable_prefix_caching

    _, _, new = admit(m, "1", list(range(10)))  # 2 blocks and some more
    assert new is not None and len(new) == 3
    assert m.block_hashes("1") == []
    assert m.num_cached_blocks("1") == 0
    m.free("1")
    # Nothing is hashed, so every freed block is prepended (LIFO reuse).
    assert m.free_block_ids() == [3, 2, 1, 4]

    # No caching: a shared prefix gives no hit.
    hits, num_hit, new = admit(m, "2", list(range(16)))
    assert (hits, num_hit) == ([], 0)
    assert new == [3, 2, 1, 4]

    # The pool is exhausted.
    m.add_request("3", list(range(4)))
    assert m.get_computed_blocks("3") == ([], 0)
    assert m.allocate_slots("3", 4, num_computed_tokens=0) is None
    assert m.block_ids("3") == []
    assert m.num_prefix_cached_blocks == 0
    assert all(m.block_hash(b) is None for b in range(5))
    assert m.prefix_cache_stats() == (0, 0, 0)  # no lookups recorded with caching off
    m.check_invariants()


def test_cache_key_salting() -> None:
    m = KVCacheManager(11, 16, 8192)
    # 3 complete blocks and an incomplete block with 11 tokens.
    token_ids = [*COMMON, *[3] * 11]
    m.add_request("plain", token_ids)
    assert admit(m, "0", token_ids, cache_salt="salt1") == ([], 0, [1, 2, 3, 4])
    salted = m.block_hashes("0")
    assert len(salted) == 3
    # The salt is hashed into the first block and, through the chain, into every later one.
    assert all(a != b for a, b in zip(salted, m.block_hashes("plain")))

    # Append 5 decode tokens: the 4th block becomes full and is hashed, no new block.
    m.append_token_ids("0", [8] * 5)
    assert m.allocate_slots("0", 5, num_computed_tokens=59) == []
    assert len(m.block_hashes("0")) == 4 and m.block_hashes("0")[:3] == salted
    assert m.num_cached_blocks("0") == 4

    # Same salt: hit on the 3 common blocks.
    m.add_request("1", [*COMMON, *[4] * 11], cache_salt="salt1")
    assert m.get_computed_blocks("1") == ([1, 2, 3], 48)
    # Same content, different salt (or no salt): miss, and every hash differs.
    m.add_request("2", [*COMMON, *[4] * 11], cache_salt="salt2")
    assert m.get_computed_blocks("2") == ([], 0)
    assert len(m.block_hashes("2")) == 3
    assert all(a != b for a, b in zip(m.block_hashes("2"), salted))
    assert m.get_computed_blocks("plain") == ([], 0)


def test_cache_key_lora() -> None:
    """LoRA name is an extra key of every block: different adapters never share KV."""
    m = KVCacheManager(11, 16, 8192)
    assert admit(m, "a", [*COMMON, 9], lora_name="adapter-a")[2] == [1, 2, 3, 4]
    m.add_request("a2", [*COMMON, 7], lora_name="adapter-a")
    assert m.get_computed_blocks("a2") == ([1, 2, 3], 48)
    m.add_request("b", [*COMMON, 7], lora_name="adapter-b")
    assert m.get_computed_blocks("b") == ([], 0)
    m.add_request("base", [*COMMON, 7])
    assert m.get_computed_blocks("base") == ([], 0)
    # A cache salt equal to the LoRA name must not collide with the adapter's blocks either
    # (the salted request runs the base model, so sharing KV with the adapter would be wrong).
    m.add_request("salted", [*COMMON, 7], cache_salt="adapter-a")
    assert m.get_computed_blocks("salted") == ([], 0)
    hashes = [m.block_hashes(r) for r in ("a", "b", "base", "salted")]
    for i in range(3):
        assert len({h[i] for h in hashes}) == 4
    # Empty strings are keys too: distinct from "no LoRA" / "no salt".
    m.add_request("empty-lora", [*COMMON, 7], lora_name="")
    m.add_request("empty-salt", [*COMMON, 7], cache_salt="")
    assert m.block_hashes("empty-lora")[0] != m.block_hashes("base")[0]
    assert m.block_hashes("empty-salt")[0] != m.block_hashes("base")[0]


def test_prefill_not_enough_free_blocks_with_computed_blocks() -> None:
    """When allocate_slots returns None, the hit blocks are not touched."""
    m = KVCacheManager(11, 16, 8192)
    # | Common-0 | Common-1 | Common-2 |
    assert admit(m, "0", COMMON) == ([], 0, [1, 2, 3])
    block_part0 = m.block_ids("0")

    # | Common-0 | Common-1 | Common-2 | Req1-3 | Req1-4 | Req1-5 |
    hits, num_hit, new = admit(m, "1", COMMON * 2)
    assert hits == block_part0 and num_hit == 48
    assert new == [4, 5, 6]
    block_part1 = m.block_ids("1")
    m.free("1")
    assert {m.ref_count(b) for b in block_part1[:3]} == {1}
    assert {m.ref_count(b) for b in block_part1[3:]} == {0}

    # | Req2-0 | Req2-1 |
    assert admit(m, "2", [7] * 32) == ([], 0, [7, 8])
    assert m.num_free_blocks == 5
    assert m.free_block_ids() == [9, 10, 6, 5, 4]

    # Req3 = the 6 cached blocks + 3 new ones: 3 new + 3 evictable hits = 6 > 5 free.
    m.add_request("3", COMMON * 3)
    hits, num_hit = m.get_computed_blocks("3")
    assert hits == block_part1 and num_hit == 96
    before = snapshot(m)
    assert (
        m.allocate_slots(
            "3", 48, num_computed_tokens=0, num_new_computed_tokens=96, new_computed_blocks=hits
        )
        is None
    )
    assert {m.ref_count(b) for b in block_part1[:3]} == {1}  # held by req0 only
    assert {m.ref_count(b) for b in block_part1[3:]} == {0}  # still free
    assert m.block_ids("3") == []
    assert snapshot(m) == before
    m.check_invariants()


def test_reset_prefix_cache() -> None:
    m = KVCacheManager(11, 16, 8192)
    assert m.reset_prefix_cache()  # nothing held: trivially succeeds

    assert admit(m, "0", [*COMMON, *[3] * 7]) == ([], 0, [1, 2, 3, 4])
    hits, _, new = admit(m, "1", [*COMMON, *[4] * 7])
    assert hits == [1, 2, 3] and new == [5]

    # Fails (and changes nothing) while blocks are held.
    before = snapshot(m)
    assert m.reset_prefix_cache() is False
    assert snapshot(m) == before
    assert m.num_prefix_cached_blocks == 3

    m.free("0")
    m.free("1")
    free_order = m.free_block_ids()
    assert m.reset_prefix_cache() is True
    assert m.num_prefix_cached_blocks == 0
    assert all(m.block_hash(b) is None for b in range(11))
    assert m.free_block_ids() == free_order
    m.check_invariants()
    # The old prefix no longer hits.
    m.add_request("2", [*COMMON, 5])
    assert m.get_computed_blocks("2") == ([], 0)


def test_prefill_plp_style_duplicate_blocks() -> None:
    """Two requests computing the same prefix without hits both register their blocks
    (duplicates are kept, block tables never change); the first registered one is served, and
    when it is evicted the duplicate still serves the prefix."""
    m = KVCacheManager(11, 16, 8192)
    prompt = [*COMMON, *[3] * 7]
    m.add_request("0", prompt)
    assert m.allocate_slots("0", 55, num_computed_tokens=0) == [1, 2, 3, 4]
    m.add_request("1", prompt)  # does not read the cache (e.g. prompt logprobs)
    assert m.allocate_slots("1", 55, num_computed_tokens=0) == [5, 6, 7, 8]
    assert [m.block_hash(b) for b in (5, 6, 7)] == [m.block_hash(b) for b in (1, 2, 3)]
    assert m.num_prefix_cached_blocks == 6
    m.add_request("2", prompt)
    assert m.get_computed_blocks("2") == ([1, 2, 3], 48)
    # A duplicate registration is an equally valid hit.
    new = m.allocate_slots(
        "2", 7, num_computed_tokens=0, num_new_computed_tokens=48, new_computed_blocks=[5, 6, 7]
    )
    assert new == [9]
    m.free("2")
    m.free("0")
    m.free("1")
    assert m.free_block_ids() == [8, 4, 9, 10, 3, 2, 1, 7, 6, 5]
    # Evict 3, 2, 1: prefix blocks 0-2 are now served by the duplicates 5, 6, 7.
    assert admit(m, "big", [42] * (7 * 16))[2] == [8, 4, 9, 10, 3, 2, 1]
    m.add_request("3", prompt)
    assert m.get_computed_blocks("3") == ([5, 6, 7], 48)
    m.check_invariants()


# ------------------------------------------ 5.3 test_single_type_kv_cache_manager.py (adapted)


def test_evictable_cached_blocks_not_double_allocated() -> None:
    """Capacity counts a hit that is currently free (touching it consumes a free block), but
    only the truly new block is popped.  vLLM's version is at the single-type-manager level
    (block 2: need 2 = 1 new + 1 evictable hit, 1 block popped); this is the same through the
    manager API."""
    m = KVCacheManager(4, 2, 64)  # three usable blocks
    assert admit(m, "cached", [0, 1]) == ([], 0, [1])
    m.free("cached")
    assert m.free_block_ids() == [2, 3, 1]
    assert admit(m, "other", [9, 9]) == ([], 0, [2])
    assert m.free_block_ids() == [3, 1]

    # 3 tokens: hit block 1 (2 tokens) + 1 new block; needs 2 free blocks, and 2 are free.
    m.add_request("req", [0, 1, 5])
    hits, num_hit = m.get_computed_blocks("req")
    assert (hits, num_hit) == ([1], 2)
    new = m.allocate_slots(
        "req", 1, num_computed_tokens=0, num_new_computed_tokens=2, new_computed_blocks=hits
    )
    assert new == [3]  # exactly one new block
    assert m.block_ids("req") == [1, 3]
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_evictable_hit_counts_against_capacity() -> None:
    m = KVCacheManager(4, 2, 64)
    assert admit(m, "cached", [0, 1]) == ([], 0, [1])
    m.free("cached")
    admit(m, "x", [9, 9])
    admit(m, "y", [8, 8])
    assert m.free_block_ids() == [1]  # only the cached block itself is free
    m.add_request("req", [0, 1, 5])
    hits, num_hit = m.get_computed_blocks("req")
    assert (hits, num_hit) == ([1], 2)
    before = snapshot(m)
    # 1 new block + 1 evictable hit = 2 > 1 free: does not fit, and nothing changes.
    assert (
        m.allocate_slots(
            "req", 1, num_computed_tokens=0, num_new_computed_tokens=2, new_computed_blocks=hits
        )
        is None
    )
    assert snapshot(m) == before
    # With one more free block it fits: block 1 is touched, block 2 popped.
    m.free("x")
    assert m.free_block_ids() == [1, 2]
    new = m.allocate_slots(
        "req", 1, num_computed_tokens=0, num_new_computed_tokens=2, new_computed_blocks=hits
    )
    assert new == [2]
    m.check_invariants()


def test_held_hit_costs_no_capacity() -> None:
    """A hit held by another request is not in the free queue: adopting it consumes nothing."""
    m = KVCacheManager(4, 2, 64)
    assert admit(m, "owner", [0, 1]) == ([], 0, [1])
    admit(m, "x", [9, 9])
    assert m.free_block_ids() == [3]
    hits, num_hit, new = admit(m, "req", [0, 1, 5])
    assert (hits, num_hit, new) == ([1], 2, [3])
    assert m.ref_count(1) == 2 and m.num_free_blocks == 0


# ------------------------------------------------------- 5.1 test_kv_cache_utils.py + 2.9


@pytest.mark.parametrize(("lookahead", "expected_blocks"), [(2, 2), (4, 2), (0, 1), (6, 3)])
def test_allocate_with_lookahead(lookahead: int, expected_blocks: int) -> None:
    """Block 4: new 3 + lookahead 2 -> ceil(5/4) = 2 blocks; lookahead 4 -> ceil(7/4) = 2."""
    m = KVCacheManager(10, 4, 100)
    m.add_request("0", [0, 1, 2])
    new = m.allocate_slots("0", 3, num_computed_tokens=0, num_lookahead_tokens=lookahead)
    assert new is not None and len(new) == expected_blocks
    assert m.block_ids("0") == new
    assert m.num_cached_blocks("0") == 0
    assert m.num_prefix_cached_blocks == 0


def test_lookahead_slots_are_never_cached() -> None:
    m = KVCacheManager(10, 4, 100)
    m.add_request("0", [0, 1, 2, 3])
    assert m.allocate_slots("0", 4, num_computed_tokens=0, num_lookahead_tokens=4) == [1, 2]
    assert m.num_cached_blocks("0") == 1
    assert m.block_hash(1) == m.block_hashes("0")[0]
    assert m.block_hash(2) is None


@pytest.mark.parametrize(
    ("lookahead", "expected_blocks"),
    [
        pytest.param(4, 2, id="dflash-K3-lookahead-K+1"),
        pytest.param(0, 1, id="no-lookahead"),
    ],
)
def test_dflash_first_prefill(lookahead: int, expected_blocks: int) -> None:
    """2.9: DFlash K=3, block 16, 16-token prompt.  With K+1 = 4 lookahead slots the first
    prefill owns 2 blocks (the drafter writes positions 16..19); without them only 1."""
    m = KVCacheManager(8, 16, 1024, enable_prefix_caching=False)
    m.add_request("0", list(range(16)))
    new = m.allocate_slots("0", 16, num_computed_tokens=0, num_lookahead_tokens=lookahead)
    assert new is not None and len(new) == expected_blocks
    # The whole query window is owned: every position < 16 + lookahead.
    assert len(m.block_ids("0")) * 16 >= 16 + lookahead


def test_dflash_first_prefill_with_caching() -> None:
    m = KVCacheManager(8, 16, 1024)
    m.add_request("0", list(range(16)))
    assert m.allocate_slots("0", 16, num_computed_tokens=0, num_lookahead_tokens=4) == [1, 2]
    assert m.num_cached_blocks("0") == 1  # the prompt block; the lookahead block never
    assert m.block_hash(2) is None


@pytest.mark.parametrize("n", [12, 15, 16, 23, 24, 31, 40, 63])
def test_dflash_decode_arithmetic(n: int) -> None:
    """2.9 decode row: K=3 drafts, comp=n, num_tokens=n+1, new=1+K=4, lookahead K+1=4:
    blocks = max(len, cdiv(n+8, 16)), cached = floor((n+1)/16) (drafts are not cached)."""
    k = 3
    m = KVCacheManager(64, 16, 4096)
    m.add_request("r", list(range(n)))
    assert m.allocate_slots("r", n, num_computed_tokens=0, num_lookahead_tokens=k + 1)
    before = len(m.block_ids("r"))
    assert before == math.ceil((n + k + 1) / 16)
    m.append_token_ids("r", [7])  # the sampled token
    new = m.allocate_slots("r", 1 + k, num_computed_tokens=n, num_lookahead_tokens=k + 1)
    assert new is not None
    assert len(m.block_ids("r")) == max(before, math.ceil((n + 8) / 16))
    assert len(m.block_ids("r")) == before + len(new)
    assert m.num_cached_blocks("r") == (n + 1) // 16
    m.check_invariants()


def test_rejected_drafts_do_not_shrink_blocks() -> None:
    m = KVCacheManager(16, 4, 1024)
    m.add_request("r", list(range(10)))
    m.allocate_slots("r", 10, num_computed_tokens=0, num_lookahead_tokens=4)  # 14 -> 4 blocks
    # 3 drafts scheduled, all rejected next step: comp stays 10, 1 token accepted.
    m.append_token_ids("r", [1])
    assert m.allocate_slots("r", 4, num_computed_tokens=10, num_lookahead_tokens=4) == [5]
    m.append_token_ids("r", [2])
    # Now only 1 + 0 drafts: needs fewer slots than owned, nothing is released.
    assert m.allocate_slots("r", 1, num_computed_tokens=11) == []
    assert len(m.block_ids("r")) == 5
    assert m.num_cached_blocks("r") == 3  # 12 known tokens


def test_hit_cap_block_aligned_prompt() -> None:
    """A fully cached block-aligned 48-token prompt hits 2 blocks (cap num_tokens - 1 = 47);
    no EAGLE-style drop of the last hit block (that would give 1 block)."""
    m = KVCacheManager(11, 16, 8192)
    assert admit(m, "0", COMMON) == ([], 0, [1, 2, 3])
    assert m.num_cached_blocks("0") == 3
    m.add_request("1", COMMON)
    assert m.get_computed_blocks("1") == ([1, 2], 32)
    m.add_request("2", [*COMMON, 0])  # 49 tokens: all 3 blocks are below the cap
    assert m.get_computed_blocks("2") == ([1, 2, 3], 48)
    m.add_request("3", COMMON[:47])  # 47 tokens: only 2 full blocks exist
    assert m.get_computed_blocks("3") == ([1, 2], 32)
    m.add_request("4", COMMON[:17])
    assert m.get_computed_blocks("4") == ([1], 16)
    m.add_request("5", COMMON[:16])
    assert m.get_computed_blocks("5") == ([], 0)


def test_hit_cap_block_size_one() -> None:
    m = KVCacheManager(11, 1, 64)
    assert admit(m, "0", [5, 6, 7]) == ([], 0, [1, 2, 3])
    m.add_request("1", [5, 6, 7])
    assert m.get_computed_blocks("1") == ([1, 2], 2)
    m.add_request("2", [5])
    assert m.get_computed_blocks("2") == ([], 0)
    hits, num_hit, new = admit(m, "3", [5, 6, 7, 8])
    assert (hits, num_hit, new) == ([1, 2, 3], 3, [4])


def test_get_computed_blocks_touches_nothing() -> None:
    m = KVCacheManager(11, 16, 8192)
    admit(m, "0", [*COMMON, 1])
    m.free("0")
    m.add_request("1", [*COMMON, 2])
    before = snapshot(m)
    assert m.get_computed_blocks("1") == ([1, 2, 3], 48)
    after = snapshot(m)
    assert after.pop("prefix_cache_stats") == (2, 49 + 49, 48)
    before.pop("prefix_cache_stats")
    assert after == before


# -------------------------------------------------------------------------- all-or-nothing


def test_all_or_nothing() -> None:
    m = KVCacheManager(8, 4, 64)
    admit(m, "a", list(range(9)))  # [1, 2, 3]; blocks 1, 2 cached
    admit(m, "b", [50, 51, 52, 53, 54])  # [4, 5]; block 4 cached
    m.free("a")
    assert m.free_block_ids() == [3, 6, 7, 2, 1]
    m.add_request("c", [*range(8), 99, 98, 97])
    hits, num_hit = m.get_computed_blocks("c")
    assert (hits, num_hit) == ([1, 2], 8)
    before = snapshot(m)
    # 11 tokens + 12 lookahead -> 23 slots -> 6 blocks: 4 new + 2 evictable hits > 5 free.
    assert (
        m.allocate_slots(
            "c",
            3,
            num_computed_tokens=0,
            num_new_computed_tokens=8,
            new_computed_blocks=hits,
            num_lookahead_tokens=12,
        )
        is None
    )
    assert snapshot(m) == before
    # A running request that does not fit changes nothing either.
    assert m.allocate_slots("b", 1, num_computed_tokens=5, num_lookahead_tokens=30) is None
    assert snapshot(m) == before
    m.check_invariants()
    # Exactly fitting: 5 blocks = 3 new + 2 evictable hits.
    new = m.allocate_slots(
        "c",
        3,
        num_computed_tokens=0,
        num_new_computed_tokens=8,
        new_computed_blocks=hits,
        num_lookahead_tokens=8,
    )
    assert new == [3, 6, 7]
    assert m.num_free_blocks == 0
    m.check_invariants()


def test_full_sequence_must_fit() -> None:
    """The admission gate needs the whole prompt to fit (lookahead excluded), not just the
    scheduled chunk."""
    m = KVCacheManager(6, 4, 64)  # 5 usable blocks
    m.add_request("long", list(range(24)))  # 6 blocks
    before = snapshot(m)
    assert m.allocate_slots("long", 8, num_computed_tokens=0, full_sequence_must_fit=True) is None
    assert snapshot(m) == before
    assert m.allocate_slots("long", 8, num_computed_tokens=0) == [1, 2]
    m.free("long")

    m.add_request("fits", list(range(100, 120)))  # 20 tokens = 5 blocks
    # Gate passes (5 <= 5); lookahead is not part of the gate but is part of the allocation.
    assert m.allocate_slots(
        "fits", 8, num_computed_tokens=0, num_lookahead_tokens=4, full_sequence_must_fit=True
    ) == [3, 4, 5]
    assert (
        m.allocate_slots(
            "fits", 8, num_computed_tokens=8, num_lookahead_tokens=8, full_sequence_must_fit=True
        )
        is None
    )  # gate ok (2 more blocks), but 24 slots = 6 blocks > 5
    assert m.allocate_slots(
        "fits", 8, num_computed_tokens=8, num_lookahead_tokens=4, full_sequence_must_fit=True
    ) == [2, 1]
    m.check_invariants()


# ----------------------------------------------------------------------- max_model_len cap


@pytest.mark.parametrize(
    ("mml", "prompt", "lookahead", "expected_blocks"),
    [
        (20, 16, 8, 5),  # min(24, 20) = 20 slots -> 5 blocks, not 6
        (18, 16, 4, 5),  # min(20, 18) = 18 slots -> 5 blocks (partial last block)
        (16, 16, 4, 4),  # a prompt of exactly max_model_len gets no lookahead block
        (64, 16, 4, 5),  # uncapped
    ],
)
def test_lookahead_capped_at_max_model_len(
    mml: int, prompt: int, lookahead: int, expected_blocks: int
) -> None:
    m = KVCacheManager(10, 4, mml)
    m.add_request("r", list(range(prompt)))
    new = m.allocate_slots("r", prompt, num_computed_tokens=0, num_lookahead_tokens=lookahead)
    assert new is not None and len(new) == expected_blocks


def test_lookahead_capped_at_max_model_len_in_decode() -> None:
    m = KVCacheManager(10, 4, 20)
    m.add_request("r", list(range(18)))
    assert len(m.allocate_slots("r", 18, num_computed_tokens=0, num_lookahead_tokens=2)) == 5
    m.append_token_ids("r", [1])
    # comp 18 + 1 + 1 draft = 20 = max_model_len; lookahead 4 adds nothing beyond it.
    assert m.allocate_slots("r", 2, num_computed_tokens=18, num_lookahead_tokens=4) == []
    # The capacity check is also capped: a huge lookahead still fits in a full pool.
    assert m.allocate_slots("r", 1, num_computed_tokens=19, num_lookahead_tokens=10**9) == []
    m.append_token_ids("r", [2])
    assert m.num_tokens("r") == 20
    with pytest.raises(dflash_rs.PromptTooLongError):
        m.append_token_ids("r", [3])


# ------------------------------------------------------------------------------ hashing


@pytest.mark.parametrize("hash_algo", HASH_ALGOS)
def test_hash_algo(hash_algo: str) -> None:
    m = KVCacheManager(11, 4, 64, hash_algo=hash_algo, hash_seed=7)
    assert m.hash_algo == hash_algo
    tokens = list(range(13))
    m.add_request("a", tokens)
    hashes = m.block_hashes("a")
    assert len(hashes) == 3
    assert all(isinstance(h, bytes) and len(h) >= 16 for h in hashes)  # >= 128 bits
    assert len(set(hashes)) == 3
    # Deterministic for a given algorithm and seed; numpy and list input agree.
    m2 = KVCacheManager(11, 4, 64, hash_algo=hash_algo, hash_seed=7)
    m2.add_request("a", np.asarray(tokens, dtype=np.int32))
    m2.add_request("b", np.asarray(tokens, dtype=np.int64))
    assert m2.block_hashes("a") == hashes == m2.block_hashes("b")
    # Another seed gives other hashes.
    m3 = KVCacheManager(11, 4, 64, hash_algo=hash_algo, hash_seed=8)
    m3.add_request("a", tokens)
    assert not set(m3.block_hashes("a")) & set(hashes)
    # Chain: changing a token of block 1 changes blocks 1 and 2, not block 0.
    m.add_request("b", [0, 1, 2, 3, 4, 5, 6, 99, 8, 9, 10, 11, 12])
    hb = m.block_hashes("b")
    assert hb[0] == hashes[0] and hb[1] != hashes[1] and hb[2] != hashes[2]
    # Appending extends the chain without touching existing hashes.
    m.add_request("c", tokens[:5])
    assert m.block_hashes("c") == hashes[:1]
    m.append_token_ids("c", tokens[5:])
    assert m.block_hashes("c") == hashes
    # The prefix cache works with this algorithm.
    admit(m, "d", tokens)
    assert [m.block_hash(b) for b in m.block_ids("d")[:3]] == hashes
    m.add_request("e", [*tokens, 77])
    assert m.get_computed_blocks("e") == (m.block_ids("d")[:3], 12)
    m.check_invariants()


def test_hash_algos_differ() -> None:
    hashes = []
    for algo in HASH_ALGOS:
        m = KVCacheManager(4, 4, 64, hash_algo=algo, hash_seed=1)
        m.add_request("a", [1, 2, 3, 4])
        hashes.append(m.block_hashes("a")[0])
    assert len(set(hashes)) == len(HASH_ALGOS)


def test_default_hash_algo_is_sha256() -> None:
    m = KVCacheManager(4, 4, 64)
    assert m.hash_algo == "sha256"
    assert m.enable_prefix_caching


@pytest.mark.skipif("PYTHONHASHSEED" in os.environ, reason="PYTHONHASHSEED fixes the seed")
def test_unseeded_hashes_are_per_manager() -> None:
    """Like vLLM without PYTHONHASHSEED: the chain's root is random per manager."""
    a, b = KVCacheManager(4, 4, 64), KVCacheManager(4, 4, 64)
    a.add_request("x", [1, 2, 3, 4])
    b.add_request("x", [1, 2, 3, 4])
    assert a.block_hashes("x") != b.block_hashes("x")


# ----------------------------------------------------------------------- bookkeeping


def test_properties_and_bookkeeping() -> None:
    m = KVCacheManager(9, 8, 256, enable_prefix_caching=True, hash_algo="blake3")
    assert (m.num_blocks, m.block_size, m.max_model_len) == (9, 8, 256)
    assert m.enable_prefix_caching and m.hash_algo == "blake3"
    assert m.num_free_blocks == 8 and m.usage == 0.0 and m.num_requests == 0
    assert m.ref_count(0) == 0 and m.block_hash(0) is None
    m.add_request("a", list(range(20)))
    m.add_request("b", [1])
    assert m.has_request("a") and not m.has_request("zzz")
    assert sorted(m.request_ids()) == ["a", "b"] and m.num_requests == 2
    assert m.num_tokens("a") == 20 and m.block_ids("a") == [] and m.num_cached_blocks("a") == 0
    assert m.allocate_slots("a", 20, num_computed_tokens=0) == [1, 2, 3]
    assert m.usage == pytest.approx(3 / 8)
    # Freeing a request that never allocated forgets it and leaves the pool alone.
    before = m.free_block_ids()
    m.free("b")
    assert not m.has_request("b") and m.free_block_ids() == before
    m.free("a")
    assert m.num_requests == 0 and m.usage == 0.0
    assert m.free_block_ids() == [3, 4, 5, 6, 7, 8, 2, 1]  # partial block 3 first
    # The id can be reused after free.
    m.add_request("a", [3])
    assert m.block_ids("a") == []
    m.check_invariants()


def test_token_containers_hash_alike() -> None:
    """Lists, tuples, ranges, numpy int32/int64 arrays and non-contiguous views are the same
    token sequence (and give the same chain of hashes)."""
    m = KVCacheManager(11, 2, 64, hash_seed=3)
    m.add_request("list", [256, 512, 3, 4, 5])
    expected = m.block_hashes("list")
    base = np.array([256, 0, 512, 0, 3, 0, 4, 0, 5, 0], dtype=np.int64)
    for rid, tokens in [
        ("tuple", (256, 512, 3, 4, 5)),
        ("i32", np.array([256, 512, 3, 4, 5], dtype=np.int32)),
        ("strided", base[::2]),
        ("reversed", np.array([5, 4, 3, 512, 256], dtype=np.int32)[::-1]),
        ("np-scalars", [np.int64(256), np.int32(512), 3, 4, 5]),
    ]:
        m.add_request(rid, tokens)
        assert m.num_tokens(rid) == 5
        assert m.block_hashes(rid) == expected, rid
    m.add_request("range", range(4))
    m.add_request("range-list", [0, 1, 2, 3])
    assert m.block_hashes("range") == m.block_hashes("range-list")


def test_block_larger_than_max_model_len() -> None:
    m = KVCacheManager(4, 128, 64)
    m.add_request("r", list(range(64)))
    assert m.allocate_slots("r", 64, num_computed_tokens=0, num_lookahead_tokens=8) == [1]
    assert m.num_cached_blocks("r") == 0  # never a full block
    m.check_invariants()
