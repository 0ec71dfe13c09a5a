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


class FakeBridge:
    """The adapter's Rust bridge as ``--breakdown`` sees it: calls, and an attribute."""

    num_spec_tokens = 3

    def schedule(self, throttle: bool, k: int) -> tuple[bool, int]:
        return throttle, k

    def engine_outputs(self, step: str) -> str:
        raise ValueError(step)

    def update_draft_token_ids(self, drafts: object) -> int:
        return 0

    def forget_previous_step(self) -> None:
        """Not a per-step call: left untimed."""


class FakeAdapter:
    def __init__(self) -> None:
        self._out = type("Outputs", (), {})()
        self._out.bridge = FakeBridge()

    def schedule(self) -> tuple[bool, int]:
        return self._out.bridge.schedule(False, self._out.bridge.num_spec_tokens)


def test_the_breakdown_times_the_bridge_calls_inside_the_schedulers_calls() -> None:
    bench = load_bench()
    timers = bench.Timers.for_args(bench.parse_args(["--breakdown"]))
    sched = FakeAdapter()
    timers.wrap_scheduler(sched)
    # Every per-step call into the bridge, the drafts' included (their time is Rust's).
    assert timers.wrap_bridge(sched) == ["schedule", "engine_outputs", "update_draft_token_ids"]
    assert sched._out.bridge.forget_previous_step() is None  # passed through, untimed

    for _ in range(3):
        assert sched.schedule() == (False, 3)  # arguments and results pass through
    with pytest.raises(ValueError, match="step"):
        sched._out.bridge.engine_outputs("step")  # so do exceptions, timed all the same

    assert [len(timers.bridge[m]) for m in ("schedule", "engine_outputs")] == [3, 1]
    summary = timers.bridge_summary()
    bridge_s = sum(summary["bridge_s_by_method"].values())
    assert 0 < bridge_s and summary["adapter_python_s"] == pytest.approx(
        sum(timers.sched.values()) - bridge_s
    )
    assert set(summary["bridge_p50_ms_by_method"]) == {"schedule", "engine_outputs"}
    # A scheduler without a bridge (vLLM's own) is left alone.
    assert timers.wrap_bridge(SleepyScheduler()) == []


def test_the_breakdown_is_printed_below_the_table_for_dflash_rs_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_bench()
    a = bench.parse_args(["--n", "256", "--spec", "none", "--breakdown"])
    breakdown = {
        "rust_share_of_scheduler": 0.69,
        "adapter_python_ms_per_step": 0.116,
        "bridge_p50_ms_by_method": {"schedule": 0.0893, "engine_outputs": 0.0887},
    }
    summary = {"none/256": {"vllm": {"reps": 1}, "dflash-rs": {"breakdown": breakdown}}}
    bench.print_breakdown(a, summary)
    assert capsys.readouterr().out.splitlines() == [
        "breakdown none N=256: 69% of dflash-rs's time in Rust, 0.116 ms a step outside it; "
        "the bridge's median calls (µs): schedule 89.3, engine_outputs 88.7"
    ]
    del summary["none/256"]["dflash-rs"]["breakdown"]
    bench.print_breakdown(a, summary)
    assert capsys.readouterr().out == ""
