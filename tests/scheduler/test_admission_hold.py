"""Admission holds through the Python API (``Scheduler.set_admission_hold``): a held request is
passed over and keeps its place, ``held_passed_over()`` names the held requests the last
``schedule()`` reached, and bad calls raise a typed error and change nothing."""

from __future__ import annotations

import pytest

from dflash_rs import InvalidArgumentError, Request, Scheduler, SchedulerConfig, UnknownRequestError

from .bad_input import snapshot


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=16,
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=256,
        )
    )


def _add(s: Scheduler, rid: str, base: int) -> None:
    s.add_request(
        Request(request_id=rid, prompt_token_ids=list(range(base, base + 20)), max_tokens=4)
    )


def test_held_request_waits_in_place_until_released() -> None:
    s = _scheduler()
    for i, rid in enumerate("abc"):
        _add(s, rid, 1000 * (i + 1))
    s.set_admission_hold("b", True)
    assert s.is_admission_held("b")
    out = s.schedule()
    assert list(out.req_ids) == ["a", "c"]
    assert s.held_passed_over() == ["b"]
    assert s.waiting_request_ids() == ["b"]
    s.check_invariants()
    s.set_admission_hold("b", False)
    assert not s.is_admission_held("b")


def test_bad_holds_raise_typed_errors_and_change_nothing() -> None:
    s = _scheduler()
    _add(s, "a", 1000)
    s.schedule()
    before = snapshot(s)
    with pytest.raises(UnknownRequestError):
        s.set_admission_hold("zz", True)
    with pytest.raises(InvalidArgumentError, match="only a waiting request"):
        s.set_admission_hold("a", True)
    with pytest.raises(UnknownRequestError):
        s.is_admission_held("zz")
    assert snapshot(s) == before
    s.check_invariants()
