"""pytest-benchmark mirrors of the criterion benches in ``rust/core/benches/core.rs``.

Same shapes as the micro-benchmarks of vLLM 0.33's KV-cache manager: a 4,096-block pool, block
size 16, a 256-token (16-block) prompt. The difference between a Python median and the matching
criterion median is the cost of crossing the boundary.

``KVCacheManager.free`` forgets the request, so every cycle has to ``add_request`` it again; each
operation is therefore measured twice, with and without the operation of interest, and the report
(``docs/BENCHMARKS.md``) quotes the difference of the medians.

Not part of the default test run (pytest's ``testpaths`` is ``tests``). Run with::

    .venv/bin/python -m pytest benches/python --benchmark-enable -q
"""

from __future__ import annotations

import itertools
from typing import Callable

import numpy as np
import pytest

import dflash_rs

POOL_BLOCKS = 4096
BLOCK_SIZE = 16
PROMPT_TOKENS = 256
PROMPT_BLOCKS = PROMPT_TOKENS // BLOCK_SIZE
MAX_MODEL_LEN = 8192
HASHED_PROMPT_TOKENS = 1100
HASH_ALGOS = ("sha256", "blake3", "xxh3_128")


@pytest.fixture(autouse=True)
def _benchmark_nodeid_shim(request: pytest.FixtureRequest) -> None:
    """pytest 9.2 dropped ``Node._nodeid``, which pytest-benchmark 5.1 reads when it builds its
    fixture (ionelmc/pytest-benchmark#321). Autouse fixtures run before the ones a test requests,
    so aliasing the public id here keeps the ``benchmark`` fixture working; a no-op elsewhere."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


def _prompt(seed: int, num_tokens: int) -> np.ndarray:
    """Random token ids (int32, the layout the bindings read without a copy per element)."""
    return np.random.default_rng(seed).integers(3, 32_000, num_tokens, dtype=np.int32)


def _manager(caching: bool, hash_algo: str = "sha256") -> dflash_rs.KVCacheManager:
    return dflash_rs.KVCacheManager(
        POOL_BLOCKS,
        BLOCK_SIZE,
        MAX_MODEL_LEN,
        enable_prefix_caching=caching,
        hash_algo=hash_algo,
        hash_seed=0,
    )


def _allocate_whole_prompt(kv: dflash_rs.KVCacheManager, request_id: str) -> int:
    """Prefix lookup + allocate_slots for the rest of a PROMPT_TOKENS prompt; returns the hit."""
    hits, num_hit_tokens = kv.get_computed_blocks(request_id)
    new_blocks = kv.allocate_slots(
        request_id,
        PROMPT_TOKENS - num_hit_tokens,
        num_computed_tokens=0,
        num_new_computed_tokens=num_hit_tokens,
        new_computed_blocks=hits,
    )
    assert new_blocks is not None
    return num_hit_tokens


def _run(benchmark, cycle: Callable[[], object], kv: dflash_rs.KVCacheManager) -> None:
    cycle()  # one warm-up cycle also runs with --benchmark-disable
    benchmark(cycle)
    kv.check_invariants()
    assert kv.num_requests == 0
    assert kv.num_free_blocks == POOL_BLOCKS - 1


# ------------------------------------------------------------------------------------------------
# allocate_slots + free of a 16-block request, caching off
# ------------------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="caching off: allocate_slots(256) + free")
def test_add_free_caching_off(benchmark) -> None:
    kv, tokens = _manager(caching=False), _prompt(0, PROMPT_TOKENS)

    def cycle() -> None:
        kv.add_request("r", tokens)
        kv.free("r")

    _run(benchmark, cycle, kv)


@pytest.mark.benchmark(group="caching off: allocate_slots(256) + free")
def test_add_allocate_free_caching_off(benchmark) -> None:
    kv, tokens = _manager(caching=False), _prompt(0, PROMPT_TOKENS)

    def cycle() -> None:
        kv.add_request("r", tokens)
        kv.allocate_slots("r", PROMPT_TOKENS, num_computed_tokens=0)
        kv.free("r")

    _run(benchmark, cycle, kv)


# ------------------------------------------------------------------------------------------------
# caching on, full prefix hit: get_computed_blocks (15 blocks) + allocate_slots (1 block) + free
# ------------------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="caching on: full prefix hit")
def test_add_free_caching_on(benchmark) -> None:
    kv, tokens = _manager(caching=True), _prompt(0, PROMPT_TOKENS)

    def cycle() -> None:
        kv.add_request("r", tokens)
        kv.free("r")

    _run(benchmark, cycle, kv)


@pytest.mark.benchmark(group="caching on: full prefix hit")
def test_add_prefix_hit_allocate_free(benchmark) -> None:
    kv, tokens = _manager(caching=True), _prompt(0, PROMPT_TOKENS)

    def cycle() -> int:
        kv.add_request("r", tokens)
        num_hit_tokens = _allocate_whole_prompt(kv, "r")
        kv.free("r")
        return num_hit_tokens

    _run(benchmark, cycle, kv)
    assert cycle() == PROMPT_TOKENS - BLOCK_SIZE


# ------------------------------------------------------------------------------------------------
# caching on, always a miss: 4x the pool's capacity of distinct prompts, every allocation evicts
# ------------------------------------------------------------------------------------------------

NUM_DISTINCT_PROMPTS = 4 * POOL_BLOCKS // PROMPT_BLOCKS


@pytest.fixture(scope="module")
def distinct_prompts() -> list[np.ndarray]:
    return [_prompt(1 + i, PROMPT_TOKENS) for i in range(NUM_DISTINCT_PROMPTS)]


@pytest.mark.benchmark(group="caching on: miss + eviction")
def test_add_free_distinct_prompts(benchmark, distinct_prompts) -> None:
    kv = _manager(caching=True)
    prompts = itertools.cycle(distinct_prompts)

    def cycle() -> None:
        kv.add_request("r", next(prompts))
        kv.free("r")

    _run(benchmark, cycle, kv)


@pytest.mark.benchmark(group="caching on: miss + eviction")
def test_add_miss_allocate_free(benchmark, distinct_prompts) -> None:
    kv = _manager(caching=True)
    prompts = itertools.cycle(distinct_prompts)

    def cycle() -> None:
        kv.add_request("r", next(prompts))
        _allocate_whole_prompt(kv, "r")
        kv.free("r")

    for _ in range(2 * NUM_DISTINCT_PROMPTS):
        cycle()  # fill the cache so that every measured allocation evicts
    _run(benchmark, cycle, kv)
    _requests, _queries, hits = kv.prefix_cache_stats()
    assert hits == 0, "the miss benchmark must never hit"


# ------------------------------------------------------------------------------------------------
# add_request of a 1,100-token prompt (68 full blocks hashed in Rust)
# ------------------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="add_request(1100 tokens) + free")
@pytest.mark.parametrize("hash_algo", [None, *HASH_ALGOS], ids=["no-hashing", *HASH_ALGOS])
def test_add_request_1100_tokens(benchmark, hash_algo: str | None) -> None:
    kv = _manager(caching=hash_algo is not None, hash_algo=hash_algo or "sha256")
    tokens = _prompt(7, HASHED_PROMPT_TOKENS)

    def cycle() -> None:
        kv.add_request("r", tokens)
        kv.free("r")

    _run(benchmark, cycle, kv)


@pytest.mark.benchmark(group="add_request(1100 tokens) + free")
def test_add_request_1100_tokens_from_list(benchmark) -> None:
    """Same as no-hashing, but from a list of ints (vLLM's prompt type)."""
    kv = _manager(caching=False)
    tokens = _prompt(7, HASHED_PROMPT_TOKENS).tolist()

    def cycle() -> None:
        kv.add_request("r", tokens)
        kv.free("r")

    _run(benchmark, cycle, kv)
