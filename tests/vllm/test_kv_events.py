"""KV-cache events (``--kv-events-config``): vLLM's ``Scheduler`` and ``DFlashRsScheduler`` on
the same seeded traces (``parity.Lockstep`` with ``kv_events=True``) publish the same
``KVEventBatch`` es, event by event: ``BlockStored`` (vLLM's block hashes in their external form,
parent hash, token ids, block size, extra keys, group and spec kind), ``BlockRemoved`` on
eviction and ``AllBlocksCleared`` on resets, in the same batches (one per
``update_from_output`` that has events), on top of everything the parity traces compare.
Also: the publisher is vLLM's own (``EventPublisherFactory``), with the data-parallel rank, and
events off leaves the scheduler publishing nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import EventRecorder, Lockstep, TraceParams

from dflash_rs.vllm._compat import installed

#: EAGLE runs with vLLM's defaults (on 0.33 lookahead block hashes, whose events carry
#: ``lookahead_token_ids``; prompts share a 32-token prefix, so they diverge right after a
#: block) and, as "eagle-nodrop", with ``disable_eagle_block_drop``.
NODROP = {"speculative": {"disable_eagle_block_drop": True}}

#: (method, K, policy, async steps in flight, pool blocks, reset probability, seed)
_CASES = [
    ("none", 0, "fcfs", 0, 48, 0.0, 0),
    ("none", 0, "fcfs", 0, 24, 0.0, 1),
    ("ngram", 3, "fcfs", 0, 24, 0.0, 2),
    ("dflash", 3, "fcfs", 0, 48, 0.0, 3),
    ("dflash", 3, "fcfs", 0, 24, 0.04, 4),
    ("dflash", 8, "fcfs", 0, 48, 0.0, 5),
    ("eagle-nodrop", 3, "fcfs", 0, 24, 0.0, 6),
    ("eagle", 3, "fcfs", 0, 24, 0.0, 6),
    ("eagle", 3, "fcfs", 0, 48, 0.04, 15),
    ("none", 0, "priority", 0, 24, 0.0, 7),
    ("dflash", 3, "priority", 0, 24, 0.04, 8),
    ("none", 0, "fcfs", 2, 24, 0.04, 9),
    ("dflash", 3, "fcfs", 2, 24, 0.0, 10),
    ("dflash", 3, "fcfs", 2, 48, 0.04, 11),
    ("eagle-nodrop", 3, "fcfs", 2, 24, 0.0, 12),
    ("eagle", 3, "fcfs", 2, 24, 0.0, 12),
    ("dflash", 3, "priority", 2, 24, 0.04, 13),
    ("dflash", 3, "fcfs", 3, 24, 0.04, 14),
]


def _params(
    method: str, k: int, policy: str, in_flight: int, blocks: int, reset: float, seed: int
) -> TraceParams:
    extra: dict[str, Any] = {}
    if method == "eagle-nodrop":
        method, extra["extra"] = "eagle", NODROP
    elif method == "eagle":
        extra["prefix_len"] = 32
    if k == 8:
        extra["max_num_batched_tokens"] = 96
    if in_flight:
        extra.update(async_scheduling=True, batch_queue_size=in_flight)
    return TraceParams(
        seed=seed,
        method=method,
        k=k or 3,
        policy=policy,
        num_blocks=blocks,
        reset_prob=reset,
        kv_events=True,
        **extra,
    )


def _id(case: tuple) -> str:
    method, k, policy, in_flight, blocks, reset, seed = case
    mode = f"-async{in_flight}" if in_flight else ""
    return f"{method}-K{k}-{policy}{mode}-pool{blocks}{'-reset' if reset else ''}-seed{seed}"


def _marks(case: tuple) -> Any:
    if case[0] == "ngram" and case[3] and installed().name == "0.32":
        reason = "vLLM 0.32 refuses async scheduling with the CPU n-gram drafter"
        return pytest.param(case, id=_id(case), marks=(pytest.mark.skip(reason=reason),))
    return pytest.param(case, id=_id(case))


@pytest.mark.parametrize("case", [_marks(c) for c in _CASES])
def test_kv_events_parity(offline: Any, case: tuple) -> None:
    res = Lockstep(offline, _params(*case)).run()
    assert res.finished > 0
    assert res.kv_event_batches > 0 and res.kv_events.get("BlockStored", 0) > 0, res


def test_kv_event_traces_store_evict_and_clear(offline: Any) -> None:
    """The traces publish every kind of event (so a passing case is not vacuous)."""
    totals: dict[str, int] = {}
    for case in (_CASES[1], _CASES[4], _CASES[11]):
        res = Lockstep(offline, _params(*case)).run()
        for name, n in res.kv_events.items():
            totals[name] = totals.get(name, 0) + n
    assert set(totals) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, totals


def _scheduler(offline: Any, **events: Any) -> Any:
    from vllm.config import KVEventsConfig

    from dflash_rs.vllm import DFlashRsScheduler

    vllm = {"kv_events_config": KVEventsConfig(**events)} if events else {}
    cfg, kv = offline.configs(num_blocks=32, max_model_len=256, vllm=vllm)
    return offline.scheduler(DFlashRsScheduler, cfg, kv), cfg


def test_publisher_is_vllms_own(offline: Any) -> None:
    """Created by vLLM's EventPublisherFactory from the config, as its Scheduler does: the ZMQ
    publisher (its config reported to the engine), or the null one when events are off."""
    from vllm.distributed.kv_events import NullEventPublisher, ZmqEventPublisher

    sched, _ = _scheduler(
        offline, enable_kv_cache_events=True, publisher="zmq", endpoint="inproc://dflash-kv-test"
    )
    try:
        assert isinstance(sched.kv_event_publisher, ZmqEventPublisher)
        config = sched.get_kv_event_publisher_config()
        assert config.endpoint == "inproc://dflash-kv-test" and config.enable_kv_cache_events
    finally:
        sched.shutdown()
    off, _ = _scheduler(offline)
    assert isinstance(off.kv_event_publisher, NullEventPublisher)
    assert off.get_kv_event_publisher_config() is None
    assert not off.enable_kv_cache_events and not off.core_config.kv_events


def test_events_off_publish_nothing(offline: Any) -> None:
    """Without --kv-events-config nothing is recorded or published."""
    sched, cfg = _scheduler(offline)
    recorder = EventRecorder()
    sched.kv_event_publisher = recorder
    hasher = offline.block_hasher(cfg)
    sched.add_request(offline.request("a", list(range(100, 180)), 4, hasher))
    out = sched.schedule()
    from vllm.v1.outputs import ModelRunnerOutput

    sched.update_from_output(
        out, ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}, sampled_token_ids=[[7]])
    )
    assert recorder.batches == []
    assert sched.core.take_kv_events() == []


def test_full_report_mode_is_refused_per_request(offline: Any) -> None:
    """kv_cache_report_mode='full' (BlockStored for every prefix hit) ends the request with an
    error instead of publishing a stream vLLM would not."""
    from vllm.v1.request import RequestStatus

    sched, cfg = _scheduler(offline, enable_kv_cache_events=True, publisher="null")
    req = offline.request("a", list(range(100, 180)), 4, offline.block_hasher(cfg))
    req.kv_cache_report_mode = "full"
    sched.add_request(req)
    assert req.status == RequestStatus.FINISHED_ERROR
    assert not sched.has_request("a")
