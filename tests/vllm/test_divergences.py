"""Divergences of the Rust core from vLLM 0.33 that the parity traces found, each reduced to a
few deterministic steps: the same calls on vLLM's ``Scheduler`` and on ``DFlashRsScheduler``,
then one comparison. All are fixed; these guard the fixes (both failed before them).
"""

from __future__ import annotations

from typing import Any

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

from dflash_rs.vllm import DFlashRsScheduler


def _both(offline: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
    """(scheduler, block hasher for its requests) for vLLM's and ours, one config."""
    cfg, kv = offline.configs(**kwargs)
    hasher = offline.block_hasher(cfg)
    return [
        (offline.scheduler(Scheduler, cfg, kv), hasher),
        (offline.scheduler(DFlashRsScheduler, cfg, kv), None),
    ]


def _run(s: Any, sampled: dict[str, list[int]]) -> Any:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    mro = ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [sampled[r] for r in ids])
    s.update_from_output(out, mro)
    return out


def test_stop_trim(offline: Any) -> None:
    """A 110-token prompt; the step after its prefill verifies 3 drafts, accepts 2, but
    max_tokens=2 keeps only the first: num_computed_tokens is trimmed to 111 before caching, so
    block 6 (tokens 96..111) stays unhashed and is freed to the free-queue head (dflash-rs used
    to cache it from 113 computed tokens, and the next request got other blocks)."""
    got = []
    for s, hasher in _both(offline, num_blocks=48, method="dflash", num_speculative_tokens=3):
        s.add_request(offline.request("a", list(range(100, 210)), 2, hasher))
        _run(s, {"a": [50]})
        s.update_draft_token_ids(DraftTokenIds(["a"], [[7000, 7001, 7002]]))
        _run(s, {"a": [7000, 7001, 60]})
        s.add_request(offline.request("x", list(range(300, 320)), 2, hasher))
        got.append([r.block_ids for r in s.schedule().scheduled_new_reqs])
    vllm_blocks, ours = got
    assert vllm_blocks == [([8, 7],)]
    assert ours == vllm_blocks


def test_pad_admission(offline: Any) -> None:
    """A 33-token prompt runs and finishes (blocks 0-1 cached); the same prompt again hits 32
    tokens, leaving one: vLLM schedules 1 + K = 4 tokens with drafts [-1, -1, -1]."""
    got = []
    prompt = list(range(100, 133))
    # Without vLLM 0.32's default last-hit-block drop for DFlash, which would leave 17 tokens.
    nodrop = {"disable_eagle_block_drop": True}
    for s, hasher in _both(
        offline, num_blocks=48, method="dflash", num_speculative_tokens=3, speculative=nodrop
    ):
        s.add_request(offline.request("a", prompt, 1, hasher))
        _run(s, {"a": [50]})
        s.add_request(offline.request("b", prompt, 4, hasher))
        out = s.schedule()
        got.append((dict(out.num_scheduled_tokens), dict(out.scheduled_spec_decode_tokens)))
    vllm_step, ours = got
    assert vllm_step == ({"b": 4}, {"b": [-1, -1, -1]})
    assert ours == vllm_step
