"""The prefill cadence through the Python API: ``Scheduler.schedule(throttle_prefills=...)``
(vLLM's data-parallel prefill throttle) and ``SchedulerConfig.local_prefill_interval`` (vLLM
0.33's local cadence). A held-back step keeps running requests decoding and admits no prefill;
bad arguments raise typed errors and change nothing."""

from __future__ import annotations

from typing import Any, List

import pytest

from dflash_rs import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
)


def make(interval: int = 1) -> Scheduler:
    cfg = SchedulerConfig(num_blocks=200, max_model_len=256, local_prefill_interval=interval)
    return Scheduler(cfg)


def add(s: Scheduler, rid: str, n: int) -> None:
    i = s.get_num_unfinished_requests()
    s.add_request(Request(rid, [100 * (i + 1) + t for t in range(n)], 50, arrival_time=i))


def run(s: Scheduler, out: Any) -> None:
    tokens: List[List[int]] = [[] if c else [50] for c in out.is_prefill_chunk]
    s.update_from_output(out, ModelRunnerOutput(out.req_ids, tokens))
    s.check_invariants()


def decoding(interval: int = 1) -> Scheduler:
    s = make(interval)
    add(s, "d", 20)
    run(s, s.schedule())
    return s


def test_throttle_holds_admissions_while_decoding() -> None:
    s = decoding()
    add(s, "w", 30)
    out = s.schedule(throttle_prefills=True)
    assert out.num_scheduled_tokens == {"d": 1}
    run(s, out)
    out = s.schedule(False)
    assert out.num_scheduled_tokens == {"d": 1, "w": 30}


def test_local_interval_releases_every_nth_step() -> None:
    s = decoding(interval=3)
    add(s, "w", 30)
    for _ in range(2):
        out = s.schedule()
        assert list(out.req_ids) == ["d"]
        run(s, out)
    assert sorted(s.schedule().req_ids) == ["d", "w"]


def test_default_config_holds_nothing() -> None:
    s = decoding()
    add(s, "w", 30)
    assert sorted(s.schedule().req_ids) == ["d", "w"]
    assert s.config.local_prefill_interval == 1
    assert not s.prefill_capacity_bound


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_throttle_must_be_a_bool(bad: Any) -> None:
    s = decoding()
    add(s, "w", 30)
    with pytest.raises(ArgumentTypeError):
        s.schedule(bad)
    s.check_invariants()
    assert sorted(s.schedule().req_ids) == ["d", "w"]  # nothing changed


@pytest.mark.parametrize("bad", [0, -1, 2**31])
def test_interval_is_validated(bad: int) -> None:
    with pytest.raises(InvalidArgumentError, match="local_prefill_interval"):
        Scheduler(SchedulerConfig(num_blocks=200, max_model_len=256, local_prefill_interval=bad))
