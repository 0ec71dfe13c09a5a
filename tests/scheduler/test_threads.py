"""Several Python threads on one Scheduler: calls are serialised by the scheduler's internal
lock and keep the GIL while they work, so concurrent use is safe; a re-entrant call from the
thread already inside the scheduler is refused with a typed error, never a deadlock."""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from dflash_rs import (
    KVCacheManager,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SpeculativeConfig,
    UnknownRequestError,
)


def _scheduler(num_blocks: int = 20_000) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            max_num_seqs=512,
            max_num_batched_tokens=32_768,
            speculative=SpeculativeConfig("dflash", 8),
        )
    )


@contextmanager
def _thread_crashes() -> Iterator[list]:
    crashes: list = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: crashes.append(args.exc_value)
    try:
        yield crashes
    finally:
        threading.excepthook = previous_hook


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        if t.ident is None:
            t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a thread hung: deadlock"


def test_engine_thread_and_api_threads_share_one_scheduler() -> None:
    """One engine thread steps; other threads admit, abort and inspect requests meanwhile.
    Every call succeeds, and the final state is consistent."""
    sched = _scheduler()
    stop = threading.Event()
    errors: list[BaseException] = []
    admitted = [0] * 3

    def engine() -> None:
        try:
            while not stop.is_set() or sched.has_unfinished_requests():
                out = sched.schedule()
                sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
                sched.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
        except BaseException as e:
            errors.append(e)

    def api(t: int) -> None:
        try:
            for i in range(150):
                rid = f"t{t}-r{i}"
                sched.add_request(Request(rid, np.arange(40, dtype=np.int32) + t, 4))
                admitted[t] += 1
                if i % 7 == 0:
                    sched.finish_requests([rid])
                try:  # the engine thread may finish the request at any moment
                    assert all(b > 0 for b in sched.block_ids(rid))
                except UnknownRequestError:
                    assert not sched.has_request(rid)
                sched.stats()
                sched.check_invariants()
        except BaseException as e:
            errors.append(e)

    with _thread_crashes() as crashes:
        workers = [threading.Thread(target=api, args=(t,)) for t in range(3)]
        engine_thread = threading.Thread(target=engine)
        engine_thread.start()
        _run(workers)
        stop.set()
        _run([engine_thread])
    assert crashes == [] and errors == [], (crashes, errors)
    assert admitted == [150, 150, 150]
    assert not sched.has_unfinished_requests()
    sched.check_invariants()
    assert sched.kv_cache_usage == 0.0


def test_concurrent_steppers_never_see_a_torn_state() -> None:
    """Four threads step the same scheduler. Interleaved steps may be refused by the step
    protocol (SchedulerStateError: an output applied out of order, or an idle step asked for
    while another step awaits its output), but nothing else happens:
    no other exception, no crash, no hang, and the invariants hold."""
    sched = _scheduler()
    for i in range(512):
        sched.add_request(Request(f"r{i}", np.arange(60, dtype=np.int32) + i, 10_000))
    errors: list[BaseException] = []

    def worker() -> None:
        for _ in range(60):
            try:
                out = sched.schedule()
                sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
                sched.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
            except SchedulerStateError as e:
                refusals = ("already applied", "in order", "until an output arrives")
                assert any(r in str(e) for r in refusals), e
            except BaseException as e:
                errors.append(e)

    with _thread_crashes() as crashes:
        _run([threading.Thread(target=worker) for _ in range(4)])
    assert crashes == [] and errors == [], (crashes, errors)
    sched.check_invariants()


@pytest.mark.skipif(
    sys.version_info >= (3, 12),
    reason="CPython 3.12+ runs the collector only between bytecodes, never inside a call that "
    "runs none, and no other Python code runs inside a scheduler call",
)
def test_reentrant_call_from_inside_a_call_is_refused() -> None:
    """Up to CPython 3.11 a garbage-collector callback runs Python code in the middle of a
    scheduler call (while Python objects for the output are allocated). Calling the scheduler
    from there is refused with SchedulerStateError, instead of deadlocking on the scheduler's
    own lock."""
    sched = _scheduler()
    for i in range(64):
        sched.add_request(Request(f"r{i}", np.arange(40, dtype=np.int32) + i, 50))
    seen: list[BaseException | None] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            try:
                sched.get_num_unfinished_requests()
                seen.append(None)
            except BaseException as e:
                seen.append(e)

    threshold = gc.get_threshold()
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1_000_000, 1_000_000)
    try:
        for _ in range(20):
            out = sched.schedule()
            sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
            sched.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
    finally:
        gc.callbacks.remove(callback)
        gc.set_threshold(*threshold)
    refused = [e for e in seen if e is not None]
    assert refused, "no collection ran inside a scheduler call; the test proves nothing"
    assert all(isinstance(e, SchedulerStateError) and "re-entrant" in str(e) for e in refused)
    assert None in seen  # calls from collections outside the scheduler's calls still work
    sched.check_invariants()


def test_kv_cache_manager_is_serialised_by_the_gil() -> None:
    """KVCacheManager never releases the GIL, so threads cannot interleave inside it."""
    kv = KVCacheManager(num_blocks=4_000, block_size=16, max_model_len=4096)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            for i in range(300):
                rid = f"{t}-{i}"
                kv.add_request(rid, list(range(t, t + 100)))
                assert kv.allocate_slots(rid, 100, num_computed_tokens=0, num_lookahead_tokens=9)
                kv.free(rid)
        except BaseException as e:
            errors.append(e)

    with _thread_crashes() as crashes:
        _run([threading.Thread(target=worker, args=(t,)) for t in range(4)])
    assert crashes == [] and errors == [], (crashes, errors)
    kv.check_invariants()
    assert kv.num_free_blocks == 3_999


def test_scheduler_calls_keep_the_gil() -> None:
    """add_request, schedule and update_from_output never release the GIL. Releasing it for
    their sub-millisecond work hands it to any Python thread that wants it (an engine's input
    or output thread), and taking it back can wait out the interpreter's switch interval (5 ms
    by default): in vLLM's engine such calls took 5.5 ms instead of 0.1. Another thread spins
    on a counter while this one calls the scheduler; with a long switch interval it can run only
    if a call releases the GIL, so the counter must not move across any call."""
    sched = _scheduler()
    counter = [0]
    started, stop = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            counter[0] += 1
            if counter[0] % 64 == 0:
                time.sleep(0)  # gives the GIL back, so a call that released it gets it again

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)  # no forced switch while this thread runs the calls
    spinner = threading.Thread(target=spin, daemon=True)
    moved: list[str] = []
    try:
        spinner.start()
        started.wait()
        # Calls long enough (a batch of 1,024) for a woken thread to take a released GIL.
        for i in range(1024):
            request = Request(f"r{i}", np.arange(64, dtype=np.int32) + i, 64)
            before = counter[0]
            sched.add_request(request)
            if counter[0] != before:
                moved.append(f"add_request {i}")
        for step in range(16):
            before = counter[0]
            out = sched.schedule()
            if counter[0] != before:
                moved.append(f"schedule {step}")
            sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
            mro = ModelRunnerOutput(out.req_ids, sampled)
            before = counter[0]
            sched.update_from_output(out, mro)
            if counter[0] != before:
                moved.append(f"update_from_output {step}")
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        spinner.join(timeout=60)
    assert counter[0] > 0, "the spinning thread never ran; the test proves nothing"
    assert moved == [], f"another thread ran inside these calls: {moved}"
    sched.check_invariants()
