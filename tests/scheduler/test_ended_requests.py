"""A request the scheduler ends on its own reaches the caller through update_from_output, as a
normal finish does: one RequestOutput with no tokens and finish_reason "error" (and the same
entry in the arrays result's finished lists), exactly once.

The scheduler ends a request on its own only when the pool can never hold it. A default config
rules that out (its pool holds one max_model_len request alone, lookahead included); with
``pool_must_hold_max_model_len=False`` (vLLM's Scheduler class semantics, which the vLLM
drop-in follows) a request can outgrow the pool. Two ends exist: a running request alone and
still short (it would preempt itself forever), and an admission with nothing running that
still does not fit (a resumed request that grew past the pool).
"""

from __future__ import annotations

from typing import Any, List

import pytest

from dflash_rs import InvalidArgumentError, ModelRunnerOutput, Request, Scheduler, SchedulerConfig

BS = 16


def small_pool(**kwargs: Any) -> Scheduler:
    """4 usable blocks (64 slots) with max_model_len 128: a request can outgrow the pool."""
    return Scheduler(
        SchedulerConfig(
            num_blocks=5,
            block_size=BS,
            max_model_len=128,
            pool_must_hold_max_model_len=False,
            **kwargs,
        )
    )


def runner(out: Any) -> ModelRunnerOutput:
    return ModelRunnerOutput(out.req_ids, [[] if c else [1] for c in out.is_prefill_chunk])


def summary(results: List[Any]) -> List[tuple]:
    return [(r.request_id, r.new_token_ids, r.finished, r.finish_reason) for r in results]


def step(s: Scheduler) -> List[tuple]:
    out = s.schedule()
    s.check_invariants()
    return summary(s.update_from_output(out, runner(out)))


def test_the_small_pool_is_refused_by_default() -> None:
    with pytest.raises(InvalidArgumentError, match="8 blocks plus the null block, 9 in all"):
        SchedulerConfig(num_blocks=5, block_size=BS, max_model_len=128)
    with pytest.raises(InvalidArgumentError, match="must be a bool"):
        SchedulerConfig(num_blocks=5, pool_must_hold_max_model_len=0)  # type: ignore[arg-type]


def test_a_running_request_that_outgrows_the_pool_gets_an_error_output_once() -> None:
    """ "a" fills the pool (64 tokens) and is ended when it needs a fifth block; "b", which
    waited for blocks, is admitted in the same step, and that step's update reports both."""
    s = small_pool()
    s.add_request(Request("a", [7] * 60, max_tokens=20))
    assert step(s) == [("a", [1], False, None)]
    s.add_request(Request("b", [8] * 10, max_tokens=2))
    for _ in range(4):
        assert step(s) == [("a", [1], False, None)]
    assert s.waiting_request_ids() == ["b"], "no block is left for b"
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and list(out.req_ids) == ["b"]
    results = s.update_from_output(out, runner(out))
    assert summary(results) == [("b", [1], False, None), ("a", [], True, "error")]
    assert results[1].stop_reason is None
    assert step(s) == [("b", [1], True, "length")]
    assert not s.has_unfinished_requests() and s.num_free_blocks == 4
    assert s.stats()["num_preemptions"] == 0


def test_a_resumed_request_past_the_pool_is_ended_at_admission_and_reported_by_arrays() -> None:
    """Preempted at 65 tokens (one more than the pool holds), "a" cannot be readmitted though
    nothing runs: it is ended at admission; the arrays result lists it without a batch entry."""
    s = small_pool()
    s.add_request(Request("a", [7] * 60, max_tokens=20))
    for _ in range(5):
        step(s)
    assert len(s.all_token_ids("a")) == 65
    s.preempt_all_running(drop_stale_outputs=False)
    out = s.schedule()
    assert len(out) == 0 and out.finished_req_ids == {"a"}
    result = s.update_from_output_arrays(out, ModelRunnerOutput([], []))
    assert len(result) == 0 and result.new_token_ids.tolist() == []
    assert (result.finished_req_ids, result.finish_reasons, result.stop_reasons) == (
        ["a"],
        ["error"],
        [None],
    )
    out = s.schedule()
    assert s.update_from_output_arrays(out, ModelRunnerOutput([], [])).finished_req_ids == []
    assert not s.has_unfinished_requests() and s.num_free_blocks == 4
    s.check_invariants()


def test_a_refused_update_keeps_the_report_for_the_next_one() -> None:
    s = small_pool()
    s.add_request(Request("a", [7] * 60, max_tokens=20))
    for _ in range(5):
        step(s)
    s.add_request(Request("b", [8] * 10, max_tokens=2))
    out = s.schedule()
    assert out.finished_req_ids == {"a"}
    with pytest.raises(InvalidArgumentError):
        s.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1, 2, 3]]))
    assert summary(s.update_from_output(out, runner(out)))[-1] == ("a", [], True, "error")


def test_async_the_end_is_reported_by_the_next_update_even_of_an_older_step() -> None:
    """Two steps in flight: "a" is ended while scheduling the newer one. The older step's
    output for "a" is dropped (it is gone) and that update reports the end, once."""
    s = small_pool(async_scheduling=True)
    s.add_request(Request("a", [7] * 62, max_tokens=20))
    in_flight = [s.schedule(), s.schedule()]  # the prefill, and a decode counting on it
    for _ in range(2):
        older = in_flight.pop(0)
        assert summary(s.update_from_output(older, runner(older))) == [("a", [1], False, None)]
        in_flight.append(s.schedule())
    newest = in_flight[-1]  # it needs slot 65: alone and short
    assert newest.finished_req_ids == {"a"} and len(newest) == 0
    older = in_flight.pop(0)
    assert summary(s.update_from_output(older, runner(older))) == [("a", [], True, "error")]
    assert s.update_from_output(newest, ModelRunnerOutput([], [])) == []
    assert not s.has_unfinished_requests()
    s.check_invariants()
