"""Async scheduling (``SchedulerConfig(async_scheduling=True)``, vLLM's ``AsyncScheduler``):
the engine schedules step N+1 before it applies step N's output.

A request that samples in a step counts what it will get as output placeholders (1 + the
scheduled drafts, already in ``num_computed_tokens``) and is scheduled again with K placeholder
drafts (``-1``) that the runner fills in. Every call below is followed by ``check_invariants()``
(pool, queues, block table, in-flight bookkeeping, the ownership contract), and every step's
writes (scheduled tokens on top of the placeholders, plus the method's lookahead) are checked
against the block table with ``drivers.ownership_violations``.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

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

from .drivers import check_block_table, ownership_violations, required_lookahead

BS = 16
EOS = 2


def make(
    method: Optional[str] = "dflash",
    k: int = 3,
    *,
    async_scheduling: bool = True,
    num_blocks: int = 128,
    **kwargs: Any,
) -> Scheduler:
    speculative = None if method is None else SpeculativeConfig(method, k)
    return Scheduler(
        SchedulerConfig(
            num_blocks,
            block_size=BS,
            max_model_len=min(256, (num_blocks - 1) * BS),  # what the pool holds
            speculative=speculative,
            async_scheduling=async_scheduling,
            **kwargs,
        )
    )


def prompt(i: int, n: int) -> List[int]:
    return [100 * (i + 1) + t for t in range(n)]


def schedule(s: Scheduler) -> Any:
    """schedule(), then the block table, ownership and invariant checks."""
    out = s.schedule()
    s.check_invariants()
    check_block_table(s, out)
    cfg = s.config
    lookahead = required_lookahead(
        cfg.speculative and cfg.speculative.method, cfg.num_speculative_tokens
    )
    violations = ownership_violations(
        s, out, lookahead=lookahead, block_size=BS, max_model_len=cfg.max_model_len
    )
    assert not violations, violations
    return out


def sampled_for(out: Any, accept: Any = 0, token: int = 50) -> List[List[int]]:
    """Per entry: [] for prefill chunks, else ``accept`` accepted drafts (an int, or a callable
    of the request id) plus a bonus token. Under async scheduling the runner accepts its own
    drafts; the scheduler only saw placeholders."""
    result = []
    for rid, chunk in zip(out.req_ids, out.is_prefill_chunk):
        if chunk:
            result.append([])
            continue
        n = len(out.scheduled_spec_decode_tokens.get(rid, []))
        a = accept(rid) if callable(accept) else accept
        result.append([token + 1] * min(a, n) + [token])
    return result


def apply(s: Scheduler, out: Any, sampled: Optional[List[List[int]]] = None) -> List[Any]:
    results = s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled or sampled_for(out)))
    s.check_invariants()
    return results


# ------------------------------------------------------------------------------------------
# placeholders


def test_placeholders_with_two_steps_in_flight() -> None:
    s = make("dflash", 3)
    s.add_request(Request("a", prompt(0, 20), 50))
    s0 = schedule(s)
    assert s0.num_scheduled_tokens == {"a": 20}
    assert s0.num_output_placeholders.tolist() == [0]
    assert (s.num_computed_tokens("a"), s.num_output_placeholders("a")) == (20, 1)

    # The next step is planned before step 0's token arrives: 1 + K tokens, K placeholders.
    s1 = schedule(s)
    assert s1.num_scheduled_tokens == {"a": 4}
    assert s1.scheduled_spec_decode_tokens == {"a": [-1, -1, -1]}
    assert s1.num_computed_tokens.tolist() == [20]
    assert s1.num_output_placeholders.tolist() == [1]
    assert (s.num_computed_tokens("a"), s.num_output_placeholders("a")) == (24, 5)
    # DFlash's K + 1 query slots past the optimistic position are owned: 24 + 4 = 28.
    assert len(s.block_ids("a")) * BS >= 28

    apply(s, s0, [[7]])
    assert (len(s.all_token_ids("a")), s.num_computed_tokens("a")) == (21, 24)
    assert s.num_output_placeholders("a") == 4
    apply(s, s1, [[8, 9]])  # one of three drafts accepted
    assert (len(s.all_token_ids("a")), s.num_computed_tokens("a")) == (23, 22)
    assert s.num_output_placeholders("a") == 0


@pytest.mark.parametrize("accepted", [0, 1, 3])
def test_rejected_drafts_take_back_their_placeholders(accepted: int) -> None:
    s = make("eagle", 3)
    s.add_request(Request("a", prompt(0, 30), 200))
    queue = deque([schedule(s)])
    for _ in range(12):
        queue.append(schedule(s))
        out = queue.popleft()
        apply(s, out, sampled_for(out, accepted))
        # One decode step in flight: its 1 + K tokens are placeholders, counted as computed.
        placeholders = s.num_output_placeholders("a")
        assert placeholders == queue[0].num_scheduled_tokens["a"] == 4
        assert s.num_computed_tokens("a") + 1 == len(s.all_token_ids("a")) + placeholders
    apply(s, queue.popleft(), None)
    # Nothing in flight: computed == num_tokens - 1, as after a synchronous step.
    assert s.num_output_placeholders("a") == 0
    assert s.num_computed_tokens("a") == len(s.all_token_ids("a")) - 1


@pytest.mark.parametrize(
    "async_scheduling",
    [
        pytest.param(True, id="placeholders"),
        pytest.param(
            False,
            id="placeholders-off",
            marks=pytest.mark.xfail(
                strict=True,
                reason="without placeholders a decode whose step is in flight has nothing to "
                "compute, so the async engine only runs every other step",
            ),
        ),
    ],
)
def test_regression_a_decode_runs_in_every_step_with_a_step_in_flight(
    async_scheduling: bool,
) -> None:
    """The regression test of the feature: switched off (``async_scheduling=False``, i.e.
    placeholders ignored) the same engine loop schedules the request only every other step and
    needs twice the steps; the ``placeholders-off`` case is a strict xfail."""
    s = make("dflash", 3, async_scheduling=async_scheduling)
    s.add_request(Request("a", prompt(0, 20), 40))
    queue: deque = deque()
    scheduled_steps = 0
    for step in range(30):
        out = schedule(s)
        queue.append(out)
        if step > 0:
            assert out.num_scheduled_tokens.get("a") == 4, (
                f"step {step}: {out.num_scheduled_tokens}"
            )
            scheduled_steps += 1
        if len(queue) == 2:
            apply(s, queue.popleft(), None)
    assert scheduled_steps == 29


def test_no_over_scheduling_at_max_tokens() -> None:
    """vLLM's test_stop_by_max_tokens: without drafts, exactly prompt + max_tokens - 1 tokens
    are scheduled per request although a step is always in flight (the skip rule)."""
    s = make(None, 0)
    lengths = {"a": (10, 1), "b": (17, 5), "c": (33, 9)}
    for i, (rid, (n, m)) in enumerate(lengths.items()):
        s.add_request(Request(rid, prompt(i, n), m))
    total: Dict[str, int] = {}
    queue: deque = deque()
    for _ in range(40):
        if s.has_unfinished_requests():
            out = schedule(s)
            for rid, n in out.num_scheduled_tokens.items():
                total[rid] = total.get(rid, 0) + n
            queue.append(out)
            if len(queue) < 2:
                continue
        if not queue:
            break
        apply(s, queue.popleft(), None)
    assert total == {rid: n + m - 1 for rid, (n, m) in lengths.items()}
    assert not s.has_unfinished_requests()


def test_stop_while_a_step_is_in_flight() -> None:
    s = make("dflash", 3)
    s.add_request(Request("a", prompt(0, 20), 50, eos_token_id=EOS))
    s0 = schedule(s)
    s1 = schedule(s)
    results = apply(s, s0, [[EOS]])
    assert results[0].finish_reason == "stop"
    assert not s.has_request("a")
    assert apply(s, s1, [[5, 6]]) == []  # the step in flight for it is dropped
    s2 = schedule(s)
    assert s2.finished_req_ids == {"a"} and len(s2) == 0
    assert s.num_free_blocks == 127


def test_abort_while_a_step_is_in_flight() -> None:
    s = make("ngram", 3)
    s.add_request(Request("a", prompt(0, 20), 50))
    s.add_request(Request("b", prompt(1, 20), 50))
    s0 = schedule(s)
    s1 = schedule(s)
    assert s.finish_requests(["a"]) == ["a"]
    s.check_invariants()
    apply(s, s0, None)
    results = apply(s, s1, None)
    assert [r.request_id for r in results] == ["b"]
    assert s.schedule().finished_req_ids == {"a"}
    s.check_invariants()


def _preempting() -> Scheduler:
    """Two prompts of 4 blocks each (with DFlash's K + 1 lookahead) in 8 usable blocks: the
    second is preempted while its prefill step is in flight."""
    s = make("dflash", 3, num_blocks=9)
    s.add_request(Request("a", prompt(0, 60), 100))
    s.add_request(Request("b", prompt(1, 60), 100))
    return s


def test_preemption_while_a_step_is_in_flight_delivers_the_stale_output() -> None:
    s = _preempting()
    s0 = schedule(s)
    s1 = schedule(s)
    assert s1.preempted_req_ids == {"b"}
    assert s.request_status("b") == "preempted"
    assert (s.num_computed_tokens("b"), s.num_output_placeholders("b")) == (0, 0)
    # Step 0's output for b still arrives (vLLM 0.33 delivers it): its token is kept, its
    # counters stay reset.
    results = apply(s, s0, [[41] for _ in s0.req_ids])
    assert {r.request_id for r in results} == {"a", "b"}
    assert s.all_token_ids("b") == [*prompt(1, 60), 41]
    assert (s.num_computed_tokens("b"), s.num_output_placeholders("b")) == (0, 0)
    apply(s, s1, None)


def test_preempted_request_is_passed_over_until_its_stale_output_arrives() -> None:
    """Three steps in flight: b, preempted in step 1, still has step 0 in flight at step 2's
    schedule(). It keeps its place but is passed over; c behind it is admitted."""
    s = _preempting()
    s.add_request(Request("c", prompt(2, 20), 3))
    s0 = schedule(s)
    assert set(s0.req_ids) == {"a", "b"}
    s1 = schedule(s)
    assert s1.preempted_req_ids == {"b"}
    s2 = schedule(s)
    assert "c" in s2.num_scheduled_tokens and "b" not in s2.num_scheduled_tokens
    assert s.waiting_request_ids() == ["b"]
    for out in (s0, s1, s2):
        apply(s, out, None)


# ------------------------------------------------------------------------------------------
# bad input


def test_async_scheduling_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="async_scheduling"):
        SchedulerConfig(64, max_model_len=1008, async_scheduling="yes")  # type: ignore[arg-type]
    # A config object that skips the dataclass's checks is checked by the bindings too.
    fields = dataclasses.asdict(SchedulerConfig(64, max_model_len=1008))
    fields["async_scheduling"] = "yes"
    with pytest.raises(InvalidArgumentError, match=r"config\.async_scheduling must be a bool"):
        Scheduler(SimpleNamespace(**fields))


def test_a_sampling_entry_without_a_token_is_refused_and_changes_nothing() -> None:
    s = make("dflash", 3)
    s.add_request(Request("a", prompt(0, 20), 50))
    s0 = schedule(s)
    s1 = schedule(s)
    before = (s.num_computed_tokens("a"), s.num_output_placeholders("a"), s.all_token_ids("a"))
    with pytest.raises(InvalidArgumentError, match="sampled no token"):
        s.update_from_output(s0, ModelRunnerOutput(s0.req_ids, [[]]))
    assert (s.num_computed_tokens("a"), s.num_output_placeholders("a"), s.all_token_ids("a")) == (
        before
    )
    s.check_invariants()
    with pytest.raises(SchedulerStateError, match="in order"):
        s.update_from_output(s1, ModelRunnerOutput(s1.req_ids, [[5]]))
    apply(s, s0, [[5]])
    apply(s, s1, [[6]])


# ------------------------------------------------------------------------------------------
# randomized engine loops


def _random_loop(method: Optional[str], in_flight: int, seed: int) -> Dict[str, Any]:
    rng = random.Random(seed * 31 + in_flight)
    k = 0 if method is None else 1 + seed % 4
    s = make(method, k, num_blocks=20, max_num_batched_tokens=96, max_num_seqs=6)
    max_tokens: Dict[str, int] = {}
    outputs: Dict[str, List[int]] = {}
    queue: deque = deque()
    shared = prompt(99, 32)
    for _ in range(400):
        if len(max_tokens) < 14 and rng.random() < 0.5:
            rid = f"r{len(max_tokens)}"
            body = prompt(len(max_tokens), rng.randint(1, 90))
            max_tokens[rid] = rng.randint(1, 60)
            tokens = [*shared, *body] if rng.random() < 0.5 else body
            s.add_request(Request(rid, tokens, max_tokens[rid], eos_token_id=EOS))
            s.check_invariants()
        if rng.random() < 0.03 and s.has_unfinished_requests():
            s.finish_requests([rng.choice(s.running_request_ids() + s.waiting_request_ids())])
            s.check_invariants()
        if s.has_unfinished_requests():
            try:
                queue.append(schedule(s))
            except SchedulerStateError:
                # An idle third step with two awaiting output is refused: apply the oldest.
                assert in_flight > 2 and len(queue) >= 2
            else:
                if len(queue) < in_flight:
                    continue
        if not queue:
            if len(max_tokens) >= 14:
                break
            continue
        out = queue.popleft()
        accepted = {rid: rng.randint(0, k) for rid in out.req_ids}
        sampled = sampled_for(out, accepted.__getitem__, token=rng.randint(3, 500))
        if rng.random() < 0.05:
            sampled = [[*x[:-1], EOS] if x else x for x in sampled]
        for r in apply(s, out, sampled):
            outputs.setdefault(r.request_id, []).extend(r.new_token_ids)
    assert not s.has_unfinished_requests() and not queue
    assert s.num_free_blocks == 19
    for rid, tokens in outputs.items():
        assert 0 < len(tokens) <= max_tokens[rid], (rid, len(tokens))
    return dict(s.stats())


@pytest.mark.parametrize("method", [None, "ngram", "eagle", "mtp", "dflash"])
@pytest.mark.parametrize("in_flight", [2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_random_async_engine_loops_keep_every_invariant(
    method: Optional[str], in_flight: int, seed: int
) -> None:
    """Arrivals, shared prefixes, random acceptance, EOS, aborts and a small pool (so requests
    are preempted with steps in flight); invariants and ownership after every call, and every
    request finishes with at most max_tokens tokens."""
    _random_loop(method, in_flight, seed)


def test_random_async_engine_loops_preempt_requests_in_flight() -> None:
    """The loops above are not vacuous: their pool is small enough to preempt requests."""
    stats = [_random_loop("dflash", in_flight, seed) for in_flight in (2, 3) for seed in range(4)]
    assert sum(st["num_preemptions"] for st in stats) >= 5
