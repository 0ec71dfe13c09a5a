"""``benches/vllm_engine_e2e.py --clock``: what its timers count (no engine needed)."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benches" / "vllm_engine_e2e.py"
SLEEP_S = 0.2


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("vllm_engine_e2e", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SleepyScheduler:
    """A scheduler whose step waits without using the CPU, as a call blocked on I/O would."""

    def schedule(self) -> str:
        time.sleep(SLEEP_S)
        return "out"


class SleepyCore:
    def __init__(self) -> None:
        self.step_fn = lambda: time.sleep(SLEEP_S)
        self.post_step = lambda model_executed: None


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_a_wait_counts_in_wall_time_and_not_in_cpu_time(clock: str) -> None:
    bench = load_bench()
    timers = bench.Timers.for_args(bench.parse_args(["--clock", clock]))
    sched, core = SleepyScheduler(), SleepyCore()
    assert "schedule" in timers.wrap_scheduler(sched)
    timers.wrap_core(core)

    assert sched.schedule() == "out"
    core.step_fn()
    core.post_step(model_executed=True)

    assert timers.calls["schedule"] == 1 and len(timers.steps) == 1
    for seconds in (timers.sched["schedule"], timers.steps[0]):
        if clock == "wall":
            assert seconds >= SLEEP_S
        else:
            assert seconds < SLEEP_S / 4


def test_the_median_call_of_each_method() -> None:
    bench = load_bench()
    timers = bench.Timers()
    timers.call_log = [("schedule", 0.001), ("update_from_output", 0.004), ("schedule", 0.009)]
    timers.call_log += [("schedule", 0.002), ("update_from_output", 0.006)]
    medians = timers.median_ms_by_method()
    assert medians == pytest.approx({"schedule": 2.0, "update_from_output": 5.0})
