"""Outputs that never come right (issue 16, defects 4 and 5).

An empty sample for a decode that verified drafts is refused (vLLM skips the drafts' rollback
and leaves ``num_computed_tokens`` past the tokens, so the request is never scheduled again). A
step whose output is lost is given up with ``Scheduler.abandon_step(out)``: its requests roll
back and are scheduled again, with async scheduling together with the younger step built on it.
An idle ``schedule()`` while the step it waits for is in flight raises ``SchedulerStateError``
instead of returning empty steps forever.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any, Dict, List

import numpy as np
import pytest

from dflash_rs import (
    InvalidArgumentError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SpeculativeConfig,
)

BS = 16


def make(k: int = 4, *, async_scheduling: bool = False, **kwargs: Any) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            kwargs.pop("num_blocks", 64),
            block_size=BS,
            max_model_len=256,
            speculative=SpeculativeConfig("dflash", k),
            async_scheduling=async_scheduling,
            **kwargs,
        )
    )


def sampled_for(out: Any, token: int = 7) -> List[List[int]]:
    return [[] if chunk else [token] for chunk in out.is_prefill_chunk]


def apply(s: Scheduler, out: Any, sampled: Any = None) -> List[Any]:
    results = s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled or sampled_for(out)))
    s.check_invariants()
    return results


def state(s: Scheduler, ids: List[str]) -> Any:
    per_request = [
        (
            s.request_status(r),
            s.num_computed_tokens(r),
            s.num_output_placeholders(r),
            tuple(s.block_ids(r)),
            tuple(s.all_token_ids(r)),
        )
        for r in ids
        if s.has_request(r)
    ]
    return (s.num_free_blocks, s.waiting_request_ids(), s.running_request_ids(), per_request)


def decoding_with_drafts(k: int = 4) -> Scheduler:
    s = make(k)
    s.add_request(Request("a", list(range(1, 16)), max_tokens=40))
    apply(s, s.schedule())
    s.update_draft_token_ids({"a": [1, 2, 3, 4][:k]})
    return s


# ------------------------------------------------------------------------------------------
# defect 4: an empty sample for a decode with drafts


@pytest.mark.parametrize("path", ["lists", "arrays"])
def test_an_empty_sample_for_a_decode_with_drafts_is_refused_and_changes_nothing(
    path: str,
) -> None:
    s = decoding_with_drafts()
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 5}
    before = (state(s, ["a"]), s.stats())
    if path == "lists":
        runner = ModelRunnerOutput(out.req_ids, [[]])
    else:
        runner = ModelRunnerOutput.from_arrays(
            out.req_ids, np.zeros(0, np.int32), np.zeros(1, np.int32)
        )
    with pytest.raises(InvalidArgumentError, match="verified 4 draft tokens but sampled no token"):
        s.update_from_output_arrays(out, runner)
    assert (state(s, ["a"]), s.stats()) == before
    s.check_invariants()
    # The step still awaits its output, and the real one applies: a keeps decoding.
    apply(s, out, [[1, 9]])
    assert s.num_computed_tokens("a") == len(s.all_token_ids("a")) - 1
    while s.has_unfinished_requests():
        apply(s, s.schedule())
    assert s.num_free_blocks == 63


# ------------------------------------------------------------------------------------------
# defect 5: lost steps


def test_an_idle_schedule_while_a_step_awaits_its_output_raises_what_is_pending() -> None:
    s = make()
    s.add_request(Request("a", list(range(1, 16)), max_tokens=40))
    s.add_request(Request("b", list(range(100, 115)), max_tokens=40))
    out = s.schedule()  # the runner raises: this output is lost
    before = (state(s, ["a", "b"]), s.stats())
    for _ in range(3):
        with pytest.raises(SchedulerStateError, match=r"step 0 \(2 requests\) is awaiting output"):
            s.schedule()
    assert (state(s, ["a", "b"]), s.stats()) == before
    s.check_invariants()
    assert s.abandon_step(out) == 1
    retry = s.schedule()
    assert retry.num_scheduled_tokens == out.num_scheduled_tokens
    apply(s, retry)


def test_without_refuse_idle_steps_an_idle_schedule_returns_the_empty_step() -> None:
    """vLLM's Scheduler class returns an empty step whatever is in flight (the drop-in follows
    it; vLLM's engine decides how many steps it keeps in flight)."""
    s = make(refuse_idle_steps=False)
    s.add_request(Request("a", list(range(1, 16)), max_tokens=40))
    out = s.schedule()
    for _ in range(2):
        idle = s.schedule()
        assert idle.req_ids == () and idle.total_num_scheduled_tokens == 0
    s.check_invariants()
    assert s.abandon_step(out) == 1
    assert s.schedule().req_ids == ("a",)


def test_abandoned_admissions_go_back_to_the_queue_and_are_admitted_again() -> None:
    s = make()
    s.add_request(Request("a", list(range(1, 40)), max_tokens=3))
    s.add_request(Request("b", list(range(100, 115)), max_tokens=3))
    initial = state(s, ["a", "b"])
    out = s.schedule()
    assert s.abandon_step(out) == 1
    s.check_invariants()
    assert state(s, ["a", "b"]) == initial
    assert s.abandon_step(out) == 0  # already abandoned
    with pytest.raises(SchedulerStateError, match="abandoned"):
        s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled_for(out)))
    retry = s.schedule()
    assert [r.req_id for r in retry.scheduled_new_reqs] == ["a", "b"]
    assert retry.num_scheduled_tokens == out.num_scheduled_tokens
    tokens: Dict[str, List[int]] = {}
    apply(s, retry)
    while s.has_unfinished_requests():
        for r in apply(s, s.schedule()):
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
    assert s.num_free_blocks == 63


def test_an_abandoned_decode_rolls_back_drops_its_drafts_and_keeps_its_blocks() -> None:
    s = decoding_with_drafts()
    computed = s.num_computed_tokens("a")
    out = s.schedule()
    blocks = s.block_ids("a")
    assert s.abandon_step(out) == 1
    s.check_invariants()
    assert s.num_computed_tokens("a") == computed
    assert s.block_ids("a") == blocks
    retry = s.schedule()
    assert retry.num_scheduled_tokens == {"a": 1}  # the drafts were dropped
    assert retry.scheduled_spec_decode_tokens == {}
    assert retry.block_table[0, : len(blocks)].tolist() == blocks
    apply(s, retry)


def test_an_abandoned_prefill_leaves_no_prefix_hit_on_kv_never_computed() -> None:
    s = make()
    s.add_request(Request("a", list(range(1, 65)), max_tokens=4))
    out = s.schedule()
    s.abandon_step(out)
    s.finish_requests(["a"])
    s.add_request(Request("b", list(range(1, 65)), max_tokens=4))
    (b,) = s.schedule().scheduled_new_reqs
    assert b.num_computed_tokens == 0


def test_with_async_scheduling_the_younger_step_is_abandoned_with_the_oldest() -> None:
    s = make(3, async_scheduling=True)
    s.add_request(Request("a", list(range(1, 21)), max_tokens=30))
    apply(s, s.schedule())
    before = state(s, ["a"])
    s1 = s.schedule()
    s2 = s.schedule()
    with pytest.raises(SchedulerStateError, match="not the oldest"):
        s.abandon_step(s2)
    assert s.abandon_step(s1) == 2
    assert s.abandon_step(s2) == 0
    s.check_invariants()
    assert state(s, ["a"]) == before
    assert s.num_output_placeholders("a") == 0
    for out in (s1, s2):
        with pytest.raises(SchedulerStateError, match="abandoned"):
            s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled_for(out)))
    n = 0
    while s.has_unfinished_requests():
        for r in apply(s, s.schedule()):
            n += len(r.new_token_ids)
    assert n == 29  # one token came from the first step


def test_requests_finished_while_the_step_is_in_flight_stay_gone() -> None:
    s = make()
    s.add_request(Request("a", list(range(1, 16)), max_tokens=5))
    s.add_request(Request("b", list(range(100, 115)), max_tokens=5))
    out = s.schedule()
    s.finish_requests(["a"])
    assert s.abandon_step(out) == 1
    s.check_invariants()
    assert not s.has_request("a") and s.waiting_request_ids() == ["b"]


def test_abandon_step_refuses_other_schedulers_outputs_and_applied_steps() -> None:
    s, other = make(), make()
    for x in (s, other):
        x.add_request(Request("a", list(range(1, 16)), max_tokens=5))
    out = s.schedule()
    with pytest.raises(InvalidArgumentError, match="another Scheduler"):
        other.abandon_step(out)
    apply(s, out)
    with pytest.raises(SchedulerStateError, match="awaits no output"):
        s.abandon_step(out)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_random_engine_loops_with_lost_steps_keep_every_invariant(
    async_scheduling: bool, seed: int
) -> None:
    """Arrivals, aborts, random acceptance and a small pool (preemptions); one step in ten is
    lost and abandoned. Invariants after every call; every request ends with at most
    max_tokens tokens, none of them from an abandoned step, and the pool is free at the end."""
    rng = random.Random(seed)
    s = make(3, async_scheduling=async_scheduling, num_blocks=20, max_num_batched_tokens=96)
    depth = 2 if async_scheduling else 1
    max_tokens: Dict[str, int] = {}
    tokens: Dict[str, List[int]] = {}
    queue: deque = deque()
    lost = 0
    for _ in range(500):
        if len(max_tokens) < 14 and rng.random() < 0.4:
            rid = f"r{len(max_tokens)}"
            max_tokens[rid] = rng.randint(1, 30)
            s.add_request(
                Request(
                    rid, [rng.randint(3, 900) for _ in range(rng.randint(1, 70))], max_tokens[rid]
                )
            )
        if rng.random() < 0.03 and s.has_unfinished_requests():
            s.finish_requests([rng.choice(s.running_request_ids() + s.waiting_request_ids())])
        if s.has_unfinished_requests() and len(queue) < depth:
            queue.append(s.schedule())
            s.check_invariants()
            if len(queue) < depth:
                continue
        if not queue:
            if len(max_tokens) >= 14:
                break
            continue
        out = queue.popleft()
        if len(out) and rng.random() < 0.1:
            lost += s.abandon_step(out)
            s.check_invariants()
            queue.clear()  # the younger step was abandoned with it
            continue
        sampled = [
            []
            if chunk
            else [
                rng.randint(3, 900)
                for _ in range(
                    1 + rng.randint(0, len(out.scheduled_spec_decode_tokens.get(rid, [])))
                )
            ]
            for rid, chunk in zip(out.req_ids, out.is_prefill_chunk)
        ]
        for r in apply(s, out, sampled):
            tokens.setdefault(r.request_id, []).extend(r.new_token_ids)
    assert lost > 0
    assert not s.has_unfinished_requests() and not queue
    assert s.num_free_blocks == 19
    for rid, got in tokens.items():
        assert 0 < len(got) <= max_tokens[rid], (rid, len(got))
