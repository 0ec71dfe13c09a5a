"""The garbage collector sees a Scheduler's references: weak references work and reference
cycles through a scheduler (its config holding it, as an engine object kept on the config
would) are collected instead of leaking the scheduler, its pool and its block table."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, List

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig

from .drivers import make_scheduler


class _Holder:
    """A weak-referenceable stand-in for an engine object that keeps the scheduler."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler


@dataclass(frozen=True)
class _EngineConfig(SchedulerConfig):
    """A config subclass with a mutable field, as engines extend configs."""

    listeners: List[Any] = field(default_factory=list)


def _with_requests(sched: Scheduler) -> Scheduler:
    """Interned ids, a cached req_ids list and a step in flight: every reference it holds."""
    sched.add_request(Request("a", [1, 2, 3], 4))
    sched.add_request(Request("b", [4, 5], 4))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[6], [7]]))
    sched.schedule()
    return sched


def _collected(ref: weakref.ref[Any]) -> bool:
    gc.collect()
    return ref() is None


def test_scheduler_is_weakly_referenceable() -> None:
    sched = make_scheduler(10)
    ref = weakref.ref(sched)
    assert ref() is sched
    del sched
    assert ref() is None  # no cycle: freed by reference counting alone


def test_cycle_through_a_duck_config_is_collected() -> None:
    config = SimpleNamespace(**vars(SchedulerConfig(20, max_model_len=128)))
    sched = _with_requests(Scheduler(config))
    config.engine = _Holder(sched)  # scheduler -> config -> holder -> scheduler
    refs = [weakref.ref(sched), weakref.ref(config.engine)]
    del sched, config
    assert all(_collected(r) for r in refs)


def test_cycle_through_a_config_subclass_is_collected() -> None:
    config = _EngineConfig(20, max_model_len=128)
    sched = _with_requests(Scheduler(config))
    config.listeners.append(sched)
    ref = weakref.ref(sched)
    del sched, config
    assert _collected(ref)


def test_a_live_scheduler_survives_collections() -> None:
    config = _EngineConfig(20, max_model_len=128)
    sched = Scheduler(config)
    sched.add_request(Request("a", [1, 2, 3], 4))
    sched.add_request(Request("b", [4, 5], 4))
    config.listeners.append(sched)
    out = sched.schedule()
    gc.collect()
    assert sched.config is config and sched.running_request_ids() == ["a", "b"]
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1]] * len(out.req_ids)))
    out = sched.schedule()
    gc.collect()
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1]] * len(out.req_ids)))
    sched.check_invariants()


_COLLECT_WHILE_BUSY = """
import gc, threading
from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
config = SchedulerConfig(4096, block_size=16, max_num_seqs=512, max_num_batched_tokens=8192)
sched = Scheduler(config)
for i in range(512):
    sched.add_request(Request(f"r{i}", list(range(8)), 10**6, ignore_eos=True))
stop = threading.Event()
def loop():
    while not stop.is_set():
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1]] * len(out.req_ids)))
worker = threading.Thread(target=loop)
worker.start()
for _ in range(300):
    gc.collect()
stop.set()
worker.join()
sched.check_invariants()
print("ok")
"""


def test_collection_while_another_thread_holds_the_scheduler_neither_blocks_nor_fails() -> None:
    """Collections run while another thread steps the scheduler: __traverse__ never waits for
    the state (a collection inside a call, on that call's thread, finds it held and skips it).
    In a child process with a timeout, so that a deadlock fails the test instead of hanging the
    session."""
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT_WHILE_BUSY],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
