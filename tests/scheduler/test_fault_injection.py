"""An internal error inside the scheduler reaches Python as a typed exception, never as an
abort or a Rust panic crossing into the interpreter. Uses the test-only fault hook that
`make develop` builds in (`dflash_rs._core._inject_fault`); release wheels do not have it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from dflash_rs import (
    InvariantError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SpeculativeConfig,
    _core,
)

inject = getattr(_core, "_inject_fault", None)
pytestmark = pytest.mark.skipif(
    inject is None, reason="built without the fault-injection feature (a release wheel)"
)


@pytest.fixture
def sched() -> Iterator[Scheduler]:
    s = Scheduler(
        SchedulerConfig(
            num_blocks=200, max_model_len=1024, speculative=SpeculativeConfig("dflash", 4)
        )
    )
    for i in range(8):
        s.add_request(Request(f"r{i}", np.arange(30, dtype=np.int32) + i, 20))
    yield s
    inject("schedule.begin", "off")


def _step(s: Scheduler) -> None:
    out = s.schedule()
    sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
    s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))


@pytest.mark.parametrize("point", ["schedule.begin", "update.begin", "add_request.begin"])
def test_internal_error_before_any_change_raises_and_keeps_state(
    sched: Scheduler, point: str
) -> None:
    _step(sched)
    before = (sched.num_free_blocks, sched.get_request_counts(), sched.stats()["num_steps"])
    out = runner = None
    if point == "update.begin":
        out = sched.schedule()
        runner = ModelRunnerOutput(out.req_ids, [[1] for _ in out.req_ids])
        before = (sched.num_free_blocks, sched.get_request_counts(), sched.stats()["num_steps"])
    inject(point, "error")
    with pytest.raises(InvariantError, match=f"injected fault at {point}"):
        if point == "schedule.begin":
            sched.schedule()
        elif point == "add_request.begin":
            sched.add_request(Request("new", [1, 2, 3], 5))
        else:
            sched.update_from_output(out, runner)
    sched.check_invariants()
    assert (
        sched.num_free_blocks,
        sched.get_request_counts(),
        sched.stats()["num_steps"],
    ) == before
    if point == "update.begin":  # the failed call changed nothing, so it can be retried
        assert len(sched.update_from_output(out, runner)) == len(out.req_ids)
    # The scheduler keeps working: the fault fires once.
    while sched.has_unfinished_requests():
        _step(sched)
    sched.check_invariants()
    assert sched.kv_cache_usage == 0.0


def test_internal_panic_becomes_an_exception_and_the_scheduler_stops(sched: Scheduler) -> None:
    _step(sched)
    inject("schedule.after_running", "panic")
    with pytest.raises(InvariantError, match="injected panic") as info:
        sched.schedule()
    assert "refuses further calls" in str(info.value)
    # State may be half updated after a panic, so every later call is refused, typed.
    for call in (sched.schedule, sched.stats, sched.check_invariants):
        with pytest.raises(SchedulerStateError, match="stopped after an internal error"):
            call()
    # Other schedulers in the process are unaffected.
    other = Scheduler(SchedulerConfig(num_blocks=50, max_model_len=512))
    other.add_request(Request("x", [1, 2, 3], 2))
    while other.has_unfinished_requests():
        _step(other)
    other.check_invariants()


def test_unknown_fault_point_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown fault point"):
        inject("nowhere", "error")
    with pytest.raises(ValueError, match="fault kind"):
        inject("schedule.begin", "explode")


def test_kv_cache_manager_turns_a_panic_into_an_exception() -> None:
    from dflash_rs import KVCacheManager

    kv = KVCacheManager(num_blocks=16, block_size=4, max_model_len=64)
    kv.add_request("a", [1, 2, 3, 4, 5])
    inject("allocate_slots.begin", "error")
    with pytest.raises(InvariantError, match="injected fault"):
        kv.allocate_slots("a", 5, num_computed_tokens=0)
    assert kv.num_free_blocks == 15  # nothing changed, and the manager still works
    assert kv.allocate_slots("a", 5, num_computed_tokens=0) is not None
    inject("allocate_slots.begin", "panic")
    with pytest.raises(InvariantError, match="injected panic") as info:
        kv.allocate_slots("a", 1, num_computed_tokens=5)
    assert "refuses further calls" in str(info.value)
    with pytest.raises(SchedulerStateError, match="stopped after an internal error"):
        kv.free("a")
