"""Shared pieces of the bad-input tests (test_errors_request.py, test_errors_config.py,
test_errors_step.py): bad input raises a typed error with a useful message and changes nothing.

Most cases run against the same populated scheduler: two running DFlash requests with drafts, a
third waiting behind max_num_seqs, and one scheduled step whose model output is still pending.
Each case compares a snapshot (free blocks, request counts, queues, every request's status,
computed tokens, tokens and blocks, stats) before and after the failing call, runs
check_invariants(), and then applies the pending step's real output, which must still work.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Type

import pytest

from dflash_rs import DFlashRsError, ModelRunnerOutput, Request, Scheduler

from .drivers import make_scheduler

MML = 64


def populated() -> Tuple[Scheduler, Any]:
    """The scheduler most cases run on (see above) and its pending step."""
    sched = make_scheduler(
        24,
        method="dflash",
        k=3,
        block_size=4,
        max_model_len=MML,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    sched.add_request(Request("run", list(range(10)), 20, arrival_time=0.0))
    sched.add_request(Request("run2", list(range(5, 12)), 20, arrival_time=1.0))
    sched.add_request(Request("wait", list(range(30, 40)), 20, arrival_time=2.0))
    out = sched.schedule()
    sched.update_from_output(
        out, ModelRunnerOutput(out.req_ids, [[1], [2]], draft_token_ids=[[3, 4], [5]])
    )
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"run": 3, "run2": 2}
    assert out.scheduled_spec_decode_tokens == {"run": [3, 4], "run2": [5]}
    sched.check_invariants()
    return sched, out


def good_sampled(out: Any) -> List[List[int]]:
    """The pending step's real samples, in batch order: each request accepts its first draft."""
    by_id = {"run": [3, 9], "run2": [5, 6]}
    return [by_id[r] for r in out.req_ids]


def good_output(out: Any) -> ModelRunnerOutput:
    """The pending step's real output (``good_sampled``)."""
    return ModelRunnerOutput(list(out.req_ids), good_sampled(out))


def snapshot(sched: Scheduler) -> Dict[str, Any]:
    """What a refused call must leave as it was: pool, counts, queues, stats and every
    request's status, computed tokens, tokens and blocks."""
    running = sched.running_request_ids()
    waiting = sched.waiting_request_ids()
    return {
        "free": sched.num_free_blocks,
        "usage": sched.kv_cache_usage,
        "counts": sched.get_request_counts(),
        "unfinished": sched.get_num_unfinished_requests(),
        "running": running,
        "waiting": waiting,
        "stats": dict(sched.stats()),
        "requests": {
            rid: (
                sched.request_status(rid),
                sched.num_computed_tokens(rid),
                sched.all_token_ids(rid),
                sched.block_ids(rid),
            )
            for rid in running + waiting
        },
    }


def duck_request(**overrides: Any) -> SimpleNamespace:
    """An object with Request's attributes that is no ``Request``: the bindings' reader checks
    it at submission, with the validator that ``Request``'s constructor calls."""
    fields: Dict[str, Any] = {
        "request_id": "duck",
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 4,
        "eos_token_id": None,
        "stop_token_ids": (),
        "ignore_eos": False,
        "min_tokens": 0,
        "priority": 0,
        "arrival_time": None,
        "lora_name": None,
        "cache_salt": None,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def duck_config(**overrides: Any) -> SimpleNamespace:
    """An object with ``SchedulerConfig``'s fields that is no ``SchedulerConfig`` (a small valid
    config; ``overrides`` replace fields): ``Scheduler`` reads it with the validator that
    ``SchedulerConfig``'s constructor calls."""
    fields: Dict[str, Any] = {
        "num_blocks": 20,
        "block_size": 16,
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
        "speculative": None,
        "hash_algo": "sha256",
        "hash_seed": None,
        "lookahead_policy": "correct",
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def other_scheduler_output() -> Any:
    """A step of another scheduler with the same step id and batch size as the pending one."""
    other = make_scheduler(24, method="dflash", k=3, block_size=4, max_model_len=MML)
    other.add_request(Request("x", [1] * 10, 20))
    other.add_request(Request("y", [2] * 7, 20))
    out = other.schedule()
    other.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1], [2]]))
    return other.schedule()


class Case(NamedTuple):
    """A bad call on ``populated()``'s scheduler and its pending step, the error it raises and a
    fragment of its message; ``prepare`` runs first (and consumes the pending step)."""

    call: Callable[[Scheduler, Any], Any]
    error: Type[BaseException]
    fragment: str
    prepare: Optional[Callable[[Scheduler, Any], Any]] = None


def check_bad_input(case: Case) -> None:
    """On a fresh ``populated()`` scheduler: ``case.call`` raises its error (a
    ``DFlashRsError`` whose message holds ``case.fragment``) and changes nothing; the
    pending step (unless ``case.prepare`` consumed it) then applies, and the next step
    schedules both running requests."""
    sched, out = populated()
    pending = True
    if case.prepare is not None:
        case.prepare(sched, out)
        pending = False
    before = snapshot(sched)
    with pytest.raises(case.error, match=re.escape(case.fragment)) as info:
        case.call(sched, out)
    assert isinstance(info.value, DFlashRsError)
    assert snapshot(sched) == before
    sched.check_invariants()
    if pending:
        # The failed call did not consume the step: its real output still applies.
        results = sched.update_from_output(out, good_output(out))
        assert {r.request_id: r.new_token_ids for r in results} == {
            "run": [3, 9],
            "run2": [5, 6],
        }
        assert sched.num_computed_tokens("run") == len(sched.all_token_ids("run")) - 1
    sched.check_invariants()
    nxt = sched.schedule()
    assert set(nxt.req_ids) == {"run", "run2"}
    sched.check_invariants()


def check_raises(make: Callable[[], Any], error: Type[BaseException], fragment: str) -> None:
    """``make()`` raises ``error``, a ``DFlashRsError`` whose message holds ``fragment``."""
    with pytest.raises(error, match=re.escape(fragment)) as info:
        make()
    assert isinstance(info.value, DFlashRsError)
