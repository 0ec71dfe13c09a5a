"""Tenant isolation in the prefix cache: different cache salts or LoRA adapters never share a
block, and a prefix-cache hit is verified against the block's tokens and prefix, so even a
forced collision of every block hash (the test-only "test-collide" hash of the dev build)
cannot hand one request another request's KV. With verification switched off (vLLM's
behaviour, kept as a test switch) the same collision does share blocks: that is what the
check guards against."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dflash_rs import (
    KVCacheManager,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
    _core,
)

BS = 16
has_collide_hook = hasattr(_core, "_inject_fault")  # the dev build's test-only features
needs_hook = pytest.mark.skipif(
    not has_collide_hook, reason="built without the fault-injection feature (a release wheel)"
)


def _run_to_completion(s: Scheduler) -> None:
    while s.has_unfinished_requests():
        out = s.schedule()
        s.check_invariants()
        s.update_from_output(
            out, ModelRunnerOutput(out.req_ids, [[] if c else [7] for c in out.is_prefill_chunk])
        )


def _admitted_blocks(s: Scheduler, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        s.add_request(r)
    s.schedule()
    return {r.request_id: s.block_ids(r.request_id) for r in requests}


@pytest.mark.parametrize("key", ["cache_salt", "lora_name"])
def test_identical_tokens_under_different_tenants_get_different_blocks(key: str) -> None:
    prompt = list(range(100, 100 + 5 * BS))
    s = Scheduler(SchedulerConfig(num_blocks=200, block_size=BS, max_model_len=(200 - 1) * BS))
    first = Request("a", prompt, 4, **{key: "tenant-1"})
    s.add_request(first)
    _run_to_completion(s)  # a's full blocks stay in the prefix cache
    blocks = _admitted_blocks(
        s,
        [
            Request("same", prompt, 4, **{key: "tenant-1"}),
            Request("other", prompt, 4, **{key: "tenant-2"}),
            Request("none", prompt, 4),
        ],
    )
    assert len(set(blocks["same"][:4]) & set(blocks["other"])) == 0
    assert len(set(blocks["same"][:4]) & set(blocks["none"])) == 0
    assert len(set(blocks["other"]) & set(blocks["none"])) == 0
    stats = s.stats()
    assert stats["prefix_cache_hits"] == 4 * BS, "only the same tenant hits a's 4 full blocks"


def _collide_manager(verify: bool) -> KVCacheManager:
    return KVCacheManager(
        num_blocks=64,
        block_size=BS,
        max_model_len=1024,
        hash_algo="test-collide",
        verify_prefix_hits=verify,
    )


def _cache_request(kv: KVCacheManager, rid: str, tokens: list[int], **extra: str) -> list[int]:
    kv.add_request(rid, tokens, **extra)
    blocks = kv.allocate_slots(rid, len(tokens), num_computed_tokens=0)
    assert blocks is not None
    return blocks


@needs_hook
@pytest.mark.parametrize(
    ("second_tokens", "extra"),
    [
        (list(range(500, 500 + 4 * BS)), {}),  # other tokens
        (list(range(4 * BS)), {"cache_salt": "tenant-2"}),  # same tokens, other tenant
        (list(range(4 * BS)), {"lora_name": "adapter-2"}),  # same tokens, other adapter
        (list(range(BS)) + list(range(900, 900 + 3 * BS)), {}),  # shared first block only
    ],
    ids=["other-tokens", "other-salt", "other-lora", "diverging-prefix"],
)
@pytest.mark.parametrize("verify", [True, False], ids=["verified", "trusted-like-vllm"])
def test_forced_collision_cannot_share_blocks(
    second_tokens: list[int], extra: dict, verify: bool
) -> None:
    kv = _collide_manager(verify)
    first_tokens = list(range(4 * BS))
    owner = _cache_request(kv, "owner", first_tokens, cache_salt="tenant-1")
    if not extra:
        extra = {"cache_salt": "tenant-1"}
    kv.add_request("intruder", [*second_tokens, 1], **extra)
    hit_blocks, hit_tokens = kv.get_computed_blocks("intruder")
    # What the intruder may legitimately reuse: the owner's leading blocks with identical
    # tokens under the identical tenant.
    same_tenant = extra.get("cache_salt") == "tenant-1" and "lora_name" not in extra
    legit = 0
    while (
        same_tenant
        and legit < 4
        and (
            first_tokens[legit * BS : (legit + 1) * BS]
            == second_tokens[legit * BS : (legit + 1) * BS]
        )
    ):
        legit += 1
    if verify:
        assert hit_blocks == owner[:legit] and hit_tokens == legit * BS
    else:
        # Trusting the (colliding) hash hands the intruder the owner's blocks: the bug.
        assert hit_tokens == 4 * BS and set(hit_blocks) <= set(owner)
        assert legit < 4
    kv.check_invariants()


def _collision_workload(verify: bool) -> None:
    """Many tenants with random prompts under a hash where every block collides: whenever two
    live requests share a block, it is a leading block with identical tokens and tenant."""
    rng = np.random.default_rng(0)
    config = SchedulerConfig(
        num_blocks=400,
        block_size=BS,
        max_model_len=4096,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        speculative=SpeculativeConfig("dflash", 3),
        verify_prefix_hits=verify,
    )
    object.__setattr__(config, "hash_algo", "test-collide")  # test-only, dev build
    s = Scheduler(config)
    bases = [rng.integers(1, 1000, size=3 * BS).tolist() for _ in range(3)]
    meta: dict[str, tuple[list[int], str]] = {}
    for i in range(60):
        base = bases[i % 3]
        tokens = base[: int(rng.integers(BS, 3 * BS))] + rng.integers(1, 1000, 5).tolist()
        salt = f"t{int(rng.integers(0, 3))}"
        meta[f"r{i}"] = (tokens, salt)
        s.add_request(Request(f"r{i}", tokens, int(rng.integers(1, 20)), cache_salt=salt))
    shared_checks = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.check_invariants()
        live = [rid for rid in meta if s.has_request(rid)]
        owners: dict[int, list[tuple[str, int]]] = {}
        for rid in live:
            for pos, b in enumerate(s.block_ids(rid)):
                owners.setdefault(b, []).append((rid, pos))
        for holders in owners.values():
            for (r1, p1), (r2, p2) in zip(holders, holders[1:]):
                shared_checks += 1
                t1, s1 = meta[r1]
                t2, s2 = meta[r2]
                same_prefix = p1 == p2 and t1[: (p1 + 1) * BS] == t2[: (p1 + 1) * BS]
                assert same_prefix and s1 == s2, f"KV shared across prefixes or tenants: {r1} {r2}"
        s.update_from_output(
            out,
            ModelRunnerOutput(
                out.req_ids, [[] if c else [int(rng.integers(1, 9))] for c in out.is_prefill_chunk]
            ),
        )
    assert shared_checks > 0, "no block was ever shared: the workload proves nothing"
    assert s.stats()["prefix_cache_hits"] > 0
    assert s.kv_cache_usage == 0.0


@needs_hook
def test_forced_collision_under_the_scheduler_keeps_every_tenant_on_its_own_kv() -> None:
    _collision_workload(verify=True)


@needs_hook
def test_the_same_workload_shares_kv_across_tenants_without_verification() -> None:
    with pytest.raises(AssertionError, match="KV shared across prefixes or tenants"):
        _collision_workload(verify=False)


def test_verify_switch_is_a_validated_config_field() -> None:
    assert SchedulerConfig(num_blocks=8, max_model_len=112).verify_prefix_hits is True
    with pytest.raises(ValueError, match="verify_prefix_hits"):
        SchedulerConfig(num_blocks=8, max_model_len=112, verify_prefix_hits="yes")  # type: ignore[arg-type]
    assert dataclasses.replace(
        SchedulerConfig(num_blocks=8, max_model_len=112), verify_prefix_hits=False
    )
