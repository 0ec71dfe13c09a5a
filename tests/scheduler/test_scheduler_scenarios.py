"""Ports of vLLM's full-attention scheduler scenarios (reference section 5.4, with its numbers),
adapted to the dflash-rs API: state is driven through schedule() / update_from_output() instead
of being injected, and checked through the public accessors.

Every step that goes through ``drivers.run_step`` also checks the block table (row i equals
block_ids(req_ids[i]), zeros past the row's count), the batch arrays, and check_invariants().
"""

from __future__ import annotations

import random
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import pytest

from dflash_rs import InvalidArgumentError, ModelRunnerOutput, Request, Scheduler

from .drivers import (
    ALL_METHODS,
    SPEC_METHODS,
    Tracker,
    assert_scheduler_empty,
    check_block_table,
    check_step_arrays,
    make_requests,
    make_scheduler,
    run_step,
)

EOS = 50256


def schedule(sched: Scheduler) -> Any:
    """schedule() plus the per-step checks."""
    out = sched.schedule()
    check_block_table(sched, out)
    check_step_arrays(sched, out)
    return out


def apply(sched: Scheduler, out: Any, sampled: Sequence[Sequence[int]], **kw: Any) -> List[Any]:
    results = sched.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled, **kw))
    sched.check_invariants()
    return results


def one_token_each(out: Any, token: int = 0) -> List[List[int]]:
    return [[] if c else [token] for c in out.is_prefill_chunk]


# ---------------------------------------------------------------------------------------------
# queue bookkeeping


def test_add_requests() -> None:
    sched = make_scheduler()
    requests = make_requests(10)
    for i, req in enumerate(requests):
        sched.add_request(req)
        assert sched.has_request(req.request_id)
        assert sched.request_status(req.request_id) == "waiting"
        assert sched.get_request_counts() == (0, i + 1)
        assert sched.get_num_unfinished_requests() == i + 1
    assert sched.waiting_request_ids() == [r.request_id for r in requests]
    assert sched.has_unfinished_requests()
    sched.check_invariants()


def test_finish_request() -> None:
    sched = make_scheduler()
    requests = make_requests(10)
    for req in requests:
        sched.add_request(req)
    for i, req in enumerate(requests):
        assert sched.finish_requests(req.request_id, "abort") == [req.request_id]
        assert not sched.has_request(req.request_id)
        assert sched.get_request_counts() == (0, 9 - i)
        # Finishing again, or an unknown id, is ignored.
        assert sched.finish_requests([req.request_id, "nope"]) == []
    sched.check_invariants()
    out = schedule(sched)
    assert out.finished_req_ids == {r.request_id for r in requests}
    assert list(out.req_ids) == []


def test_get_num_unfinished_requests() -> None:
    sched = make_scheduler()
    requests = make_requests(10)
    for req in requests:
        sched.add_request(req)
    for i, req in enumerate(requests):
        sched.finish_requests([req.request_id], status="stop")
        assert sched.get_num_unfinished_requests() == len(requests) - i - 1
    assert not sched.has_unfinished_requests()


# ---------------------------------------------------------------------------------------------
# scheduling


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_schedule(enable_prefix_caching: bool) -> None:
    sched = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = make_requests(10)
    for req in requests:
        sched.add_request(req)
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == [r.request_id for r in requests]
    assert not any(r.resumed for r in out.scheduled_new_reqs)
    assert out.scheduled_cached_reqs.req_ids == []
    assert out.finished_req_ids == set()
    assert list(out.req_ids) == [r.request_id for r in requests]
    for req in requests:
        assert out.num_scheduled_tokens[req.request_id] == len(req.prompt_token_ids)
    assert sched.running_request_ids() == [r.request_id for r in requests]
    assert sched.get_request_counts() == (10, 0)
    sched.check_invariants()


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_schedule_concurrent_partial_requests(enable_prefix_caching: bool) -> None:
    """Budget 1024, threshold 400, three 800-token prompts: 400/400/224, 400/400/224, 1/1/352."""
    sched = make_scheduler(
        10000,
        max_model_len=1024,
        long_prefill_token_threshold=400,
        block_size=16,
        max_num_batched_tokens=1024,
        enable_prefix_caching=enable_prefix_caching,
    )
    requests = make_requests(3, num_tokens=800)
    for req in requests:
        sched.add_request(req)
    ids = [r.request_id for r in requests]

    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ids
    assert out.scheduled_cached_reqs.req_ids == []
    assert [out.num_scheduled_tokens[i] for i in ids] == [400, 400, 224]
    assert out.is_prefill_chunk.tolist() == [True, True, True]
    assert apply(sched, out, [[], [], []]) == []

    out = schedule(sched)
    assert list(out.scheduled_new_reqs) == []
    assert out.scheduled_cached_reqs.req_ids == ids
    assert [out.num_scheduled_tokens[i] for i in ids] == [400, 400, 224]
    assert out.num_computed_tokens.tolist() == [400, 400, 224]
    # The first two finish their prompts and sample; the third is still a prefill chunk.
    assert out.is_prefill_chunk.tolist() == [False, False, True]
    results = apply(sched, out, [[0], [0], []])
    assert [(r.request_id, r.new_token_ids) for r in results] == [("0", [0]), ("1", [0])]

    out = schedule(sched)
    assert list(out.scheduled_new_reqs) == []
    assert [out.num_scheduled_tokens[i] for i in ids] == [1, 1, 352]
    assert out.total_num_scheduled_tokens == 354


@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_schedule_order(enable_chunked_prefill: bool) -> None:
    """Without chunked prefill a long prompt that does not fit the remaining budget stops
    admission: short requests behind it are not scheduled early."""
    sched = make_scheduler(
        max_num_batched_tokens=1024,
        max_model_len=1024,
        max_num_seqs=3,
        enable_chunked_prefill=enable_chunked_prefill,
    )
    for i, n in [("1", 800), ("2", 800), ("3", 10), ("4", 10)]:
        sched.add_request(Request(i, [int(i)] * n, 16))
    out = schedule(sched)
    if enable_chunked_prefill:
        assert [r.req_id for r in out.scheduled_new_reqs] == ["1", "2"]
        assert out.num_scheduled_tokens == {"1": 800, "2": 224}
    else:
        assert [r.req_id for r in out.scheduled_new_reqs] == ["1"]
        assert out.num_scheduled_tokens == {"1": 800}
        assert sched.waiting_request_ids() == ["2", "3", "4"]


def test_preempt_during_execution() -> None:
    """10 usable blocks, two 80-token prompts (5 blocks each). The second is admitted while the
    first's step is in flight; rescheduling the first then needs a 6th block, so the last running
    request (the second) is preempted; the second's in-flight output is still applied. A short
    request behind it is not admitted in that step, nor (head of line) in the next."""
    sched = make_scheduler(
        11, max_num_batched_tokens=100, block_size=16, enable_prefix_caching=False
    )
    r0, r1 = make_requests(2, num_tokens=80)
    sched.add_request(r0)
    out0 = schedule(sched)
    assert len(out0.num_scheduled_tokens) == 1
    assert len(out0.scheduled_new_reqs[0].block_ids) == 5

    sched.add_request(r1)
    out1 = schedule(sched)  # "0" has no new token yet: only "1" is scheduled
    assert out1.num_scheduled_tokens == {"1": 80}
    assert len(out1.scheduled_new_reqs[0].block_ids) == 5
    assert sched.num_free_blocks == 0

    apply(sched, out0, [[0]])
    sched.add_request(Request("short", [9] * 8, 4))
    out2 = schedule(sched)
    assert out2.preempted_req_ids == {"1"}
    assert out2.num_scheduled_tokens == {"0": 1}
    assert list(out2.scheduled_new_reqs) == []  # no admission in a step that preempted
    assert sched.running_request_ids() == ["0"]
    assert sched.request_status("1") == "preempted"
    assert sched.waiting_request_ids() == ["1", "short"]
    assert sched.block_ids("1") == [] and sched.num_computed_tokens("1") == 0
    assert len(sched.block_ids("0")) == 6

    # The preempted request's in-flight output is still applied.
    results = apply(sched, out1, [[42]])
    assert [(r.request_id, r.new_token_ids) for r in results] == [("1", [42])]
    assert sched.all_token_ids("1") == [1] * 80 + [42]
    assert sched.stats()["num_preemptions"] == 1

    apply(sched, out2, [[0]])
    out3 = schedule(sched)
    # "1" needs 6 blocks, 4 are free: strict FCFS, so "short" (1 block) waits behind it.
    assert out3.num_scheduled_tokens == {"0": 1}
    assert sched.waiting_request_ids() == ["1", "short"]


def test_prefix_stats_count_admissions_as_vllm_does() -> None:
    """``prefix_cache_admitted_*`` counts a first admission's lookup once, when it is admitted
    (not the lookups of steps that could not admit it), and ``prefix_cache_resumed_*`` a
    re-admission after a preemption: vLLM's ``requests``/``queries``/``hits`` and
    ``preempted_*``. The lookup counters (``prefix_cache_queries``) count every lookup."""
    sched = make_scheduler(11, max_num_batched_tokens=100, block_size=16)
    r0, r1 = make_requests(2, num_tokens=80)
    sched.add_request(r0)
    out0 = schedule(sched)
    sched.add_request(r1)
    out1 = schedule(sched)
    apply(sched, out0, [[0]])
    out2 = schedule(sched)  # preempts "1"
    assert out2.preempted_req_ids == {"1"}
    apply(sched, out1, [[42]])
    apply(sched, out2, [[0]])
    for _ in range(3):  # "1" (81 tokens, 6 blocks) cannot come back: 4 blocks are free
        out = schedule(sched)
        assert "1" not in out.num_scheduled_tokens
        apply(sched, out, [[0]])
    s = sched.stats()
    admitted = [s[f"prefix_cache_admitted_{k}"] for k in ("requests", "queries", "hits")]
    assert admitted == [2, 160, 0]
    assert s["prefix_cache_resumed_requests"] == 0
    assert s["prefix_cache_queries"] > 160  # its failed lookups, counted by the pool
    sched.finish_requests(["0"])
    out = schedule(sched)
    assert "1" in out.num_scheduled_tokens
    resumed = sched.stats()
    # Re-admitted with some of its full prompt blocks still cached (one went to "0").
    requests, queries, hits = (
        resumed[f"prefix_cache_resumed_{k}"] for k in ("requests", "queries", "hits")
    )
    assert (requests, queries) == (1, 81)
    assert 0 < hits <= 80 and hits % 16 == 0
    assert resumed["prefix_cache_admitted_requests"] == 2


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_scheduler_reset_prefix_cache(enable_prefix_caching: bool) -> None:
    sched = make_scheduler(enable_prefix_caching=enable_prefix_caching)
    requests = make_requests(10, num_tokens=40, same_prompt=True)
    for req in requests:
        sched.add_request(req)
    out = schedule(sched)
    assert sched.get_request_counts() == (10, 0)
    assert sched.running_request_ids() == [r.request_id for r in requests]
    hits = [r.num_computed_tokens for r in out.scheduled_new_reqs]
    # Same-step prefix reuse: later requests hit the first one's two full blocks.
    assert hits == ([0] + [32] * 9 if enable_prefix_caching else [0] * 10)
    free = sched.num_free_blocks
    # Requests hold blocks: the reset fails and changes nothing.
    assert sched.reset_prefix_cache() is False
    assert sched.num_free_blocks == free
    sched.check_invariants()
    apply(sched, out, [[1]] * 10)
    sched.finish_requests([r.request_id for r in requests])
    assert sched.reset_prefix_cache() is True
    sched.check_invariants()
    # After the reset nothing is cached any more.
    sched.add_request(Request("again", [0] * 40, 4))
    out = schedule(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert out.finished_req_ids == {r.request_id for r in requests}


@pytest.mark.parametrize("method", [None, "dflash"])
def test_prefix_caching_for_prefill_dedup(method: Optional[str]) -> None:
    """Two identical 100-token prompts in one step: the second schedules only 4 tokens (96 hit,
    blocks registered at schedule time); a later arrival also schedules 4. DFlash gets no
    "drop the last hit block" rule."""
    sched = make_scheduler(method=method, k=0 if method is None else 3, block_size=16)
    prompt = [random.Random(0).randrange(1000) for _ in range(100)]
    sched.add_request(Request("a", prompt, 3))
    sched.add_request(Request("b", prompt, 3))
    rng = random.Random(0)
    step = run_step(sched, rng)
    assert step.out.num_scheduled_tokens == {"a": 100, "b": 4}
    assert sched.block_ids("b")[:6] == sched.block_ids("a")[:6]
    sched.add_request(Request("c", prompt, 3))
    step = run_step(sched, rng)
    assert step.out.num_scheduled_tokens["c"] == 4
    stats = sched.stats()
    assert stats["prefix_cache_hits"] == 2 * 96


@pytest.mark.parametrize("method", [None, "dflash"])
def test_prefix_caching_for_multi_turn(method: Optional[str]) -> None:
    """The next turn's prompt (prompt + 30 outputs + new text) hits every full block of the
    first turn's 130 tokens: 128. Output blocks are cached as they are computed; draft tokens
    (all rejected here) are never cached."""
    k = 0 if method is None else 4
    sched = make_scheduler(method=method, k=k, block_size=16)
    rng = random.Random(2)
    sched.add_request(Request("turn1", [rng.randrange(1000) for _ in range(100)], 30))
    tracker = Tracker()
    drafts = "none" if method is None else "dict"
    while sched.has_request("turn1"):
        run_step(sched, rng, tracker, k=k, accept="none", drafts=drafts, vocab=1000)
    history = tracker.prompts["turn1"] + tracker.outputs["turn1"]
    assert len(history) == 130
    sched.add_request(Request("turn2", [*history, 1, 2, 3, 4, 5], 4))
    out = schedule(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 128
    assert out.num_scheduled_tokens == {"turn2": 135 - 128}


@pytest.mark.parametrize(
    "first,second,expect_hit",
    [
        ({}, {}, True),
        ({"cache_salt": "a"}, {"cache_salt": "a"}, True),
        ({"cache_salt": "a"}, {"cache_salt": "b"}, False),
        ({}, {"cache_salt": "a"}, False),
        ({"lora_name": "x"}, {"lora_name": "x"}, True),
        ({"lora_name": "x"}, {"lora_name": "y"}, False),
        ({"lora_name": "x"}, {}, False),
    ],
)
def test_prefix_hits_respect_cache_salt_and_lora(
    first: Dict[str, Any], second: Dict[str, Any], expect_hit: bool
) -> None:
    sched = make_scheduler(block_size=16)
    prompt = list(range(40))
    sched.add_request(Request("a", prompt, 2, **first))
    out = schedule(sched)
    apply(sched, out, [[1]])
    sched.add_request(Request("b", prompt, 2, **second))
    out = schedule(sched)
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == (32 if expect_hit else 0)


# ---------------------------------------------------------------------------------------------
# stop conditions


@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_stop_via_update_from_output(method: str) -> None:
    """EOS stop; stop token with stop_reason; max_tokens truncation [10, 11]; ignore_eos.
    Each request first runs its prefill (sampling 7), then a verification step with drafts."""

    def setup(k: int, n: int, **kw: Any) -> Scheduler:
        sched = make_scheduler(method=method, k=k)
        for req in make_requests(n, max_tokens=kw.pop("max_tokens", 10), **kw):
            sched.add_request(req)
        out = schedule(sched)
        apply(sched, out, [[7]] * n)
        return sched

    # Case 1: EOS.
    sched = setup(1, 2, eos_token_id=EOS)
    sched.update_draft_token_ids({"0": [], "1": [10]})
    out = schedule(sched)
    assert out.num_scheduled_tokens == {"0": 1, "1": 2}
    assert out.scheduled_spec_decode_tokens == {"1": [10]}
    results = apply(sched, out, [[EOS], [10, 11]])
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in results] == [
        ("0", [EOS], "stop"),
        ("1", [10, 11], None),
    ]
    assert results[0].stop_reason is None and results[0].finished
    assert sched.running_request_ids() == ["1"]
    assert sched.all_token_ids("1") == [1] * 10 + [7, 10, 11]
    assert sched.num_computed_tokens("1") == 12
    assert schedule(sched).finished_req_ids == {"0"}

    # Case 2: stop token; the bonus token after it is dropped.
    sched = setup(2, 2, stop_token_ids=[42, 43])
    sched.update_draft_token_ids({"0": [10, 42], "1": [13]})
    out = schedule(sched)
    assert out.num_scheduled_tokens == {"0": 3, "1": 2}
    results = apply(sched, out, [[10, 42, 12], [13, 14]])
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in results] == [
        ("0", [10, 42], "stop"),
        ("1", [13, 14], None),
    ]
    assert results[0].stop_reason == 42 and results[1].stop_reason is None
    assert sched.running_request_ids() == ["1"]

    # Case 3: max_tokens (3 = the prefill's token + 2): [10, 11, 12] is cut to [10, 11].
    sched = setup(2, 2, max_tokens=3)
    sched.update_draft_token_ids({"0": [10, 11], "1": []})
    out = schedule(sched)
    assert out.num_scheduled_tokens == {"0": 3, "1": 1}
    results = apply(sched, out, [[10, 11, 12], [13]])
    assert [(r.request_id, r.new_token_ids, r.finish_reason) for r in results] == [
        ("0", [10, 11], "length"),
        ("1", [13], None),
    ]
    assert sched.running_request_ids() == ["1"]
    assert sched.all_token_ids("1") == [1] * 10 + [7, 13]

    # Case 4: ignore_eos keeps going past EOS.
    sched = setup(2, 1, eos_token_id=EOS, ignore_eos=True)
    sched.update_draft_token_ids({"0": [EOS, 10]})
    out = schedule(sched)
    results = apply(sched, out, [[EOS, 10, 11]])
    assert [(r.new_token_ids, r.finish_reason) for r in results] == [([EOS, 10, 11], None)]
    assert sched.running_request_ids() == ["0"]
    assert sched.all_token_ids("0") == [0] * 10 + [7, EOS, 10, 11]


@pytest.mark.parametrize("cap", ["max_tokens", "max_model_len"])
@pytest.mark.parametrize("kind", ["eos", "stop_token"])
def test_stop_on_the_last_allowed_token_is_a_stop(kind: str, cap: str) -> None:
    """vLLM's check_stop order (0.23 through 0.33): min_tokens gate, EOS, stop tokens, then the
    length caps. A stop token sampled as the last allowed token therefore finishes the request
    with "stop" (and its stop_reason), not "length"."""
    token = 9 if kind == "eos" else 8
    kw: Dict[str, Any] = {"eos_token_id": 9} if kind == "eos" else {"stop_token_ids": [8]}
    if cap == "max_tokens":
        sched = make_scheduler(max_model_len=64)
        sched.add_request(Request("a", [1, 2, 3], 2, **kw))
    else:
        sched = make_scheduler(max_model_len=5)
        sched.add_request(Request("a", [1, 2, 3], 100, **kw))
    out = schedule(sched)
    assert apply(sched, out, [[5]])[0].finish_reason is None
    out = schedule(sched)
    (result,) = apply(sched, out, [[token]])
    assert result.new_token_ids == [token]
    assert (result.finish_reason, result.stop_reason) == (
        "stop",
        None if kind == "eos" else 8,
    )


def test_length_cap_at_max_model_len() -> None:
    """num_tokens reaching max_model_len finishes the request with "length"."""
    sched = make_scheduler(max_model_len=6)
    sched.add_request(Request("a", [1, 2, 3, 4], 100))
    rng = random.Random(0)
    run_step(sched, rng)
    step = run_step(sched, rng)
    (result,) = step.results
    assert result.finish_reason == "length" and not sched.has_request("a")


@pytest.mark.parametrize("stop", ["eos", "stop_token"])
def test_check_stop_min_tokens(stop: str) -> None:
    """No EOS/stop-token stop before min_tokens outputs; the stop counts once it is reached."""
    token = EOS if stop == "eos" else 42
    kw: Dict[str, Any] = {"eos_token_id": EOS} if stop == "eos" else {"stop_token_ids": [42]}

    def run(min_tokens: int, stream: List[int]) -> List[Any]:
        sched = make_scheduler()
        sched.add_request(Request("a", [0, 1, 2], 20, min_tokens=min_tokens, **kw))
        results = []
        for t in stream:
            out = schedule(sched)
            results += apply(sched, out, [[t]])
            if results[-1].finished:
                break
        return results

    # 3 outputs with the stop token last: below min_tokens=5, ignored.
    results = run(5, [10, 11, token, 12, token])
    assert [r.finish_reason for r in results] == [None, None, None, None, "stop"]
    assert results[-1].stop_reason == (None if stop == "eos" else 42)
    # The 5th output is the first that may stop.
    results = run(5, [10, 11, 12, token])
    assert [r.finish_reason for r in results] == [None] * 4
    # min_tokens = 0: normal behaviour.
    results = run(0, [token])
    assert [r.finish_reason for r in results] == ["stop"]


def test_min_tokens_inside_an_accepted_draft_run() -> None:
    """With drafts, tokens are appended one by one: the stop lands on the first stop token at
    or after min_tokens, and later tokens of the run are dropped."""
    sched = make_scheduler(method="ngram", k=4)
    sched.add_request(Request("a", [0, 1, 2], 20, eos_token_id=EOS, min_tokens=3))
    out = schedule(sched)
    apply(sched, out, [[EOS]])  # output 1: below min_tokens
    sched.update_draft_token_ids({"a": [EOS, EOS, 5, EOS]})
    out = schedule(sched)
    (result,) = apply(sched, out, [[EOS, EOS, 5, EOS, 6]])
    # outputs 2 (EOS, ignored), 3 (EOS, stops).
    assert result.new_token_ids == [EOS, EOS]
    assert result.finish_reason == "stop"


# ---------------------------------------------------------------------------------------------
# speculative decoding


@pytest.mark.parametrize("method", ["ngram", "dflash", "eagle"])
@pytest.mark.parametrize(
    "spec_tokens,output_tokens,expected",
    [
        ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),  # perfect match
        ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),  # early mismatch
        ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),  # multiple sequences
        ([[1]], [[1, 2]], (1, 1, 1, [1])),  # single token sequence
        ([[]], [[5]], (0, 0, 0, [0])),  # empty sequence
        ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),  # mismatches
    ],
)
def test_schedule_spec_decoding_stats(
    method: str,
    spec_tokens: List[List[int]],
    output_tokens: List[List[int]],
    expected: tuple,
) -> None:
    k = max(1, max(len(t) for t in spec_tokens))
    sched = make_scheduler(method=method, k=k)
    requests = make_requests(len(spec_tokens), num_tokens=1)
    ids = [r.request_id for r in requests]
    for req in requests:
        sched.add_request(req)

    out = schedule(sched)
    assert len(out.scheduled_new_reqs) == len(requests)
    assert out.total_num_scheduled_tokens == len(requests)
    assert all(out.num_scheduled_tokens[i] == 1 for i in ids)
    assert out.scheduled_spec_decode_tokens == {}
    apply(sched, out, [[0]] * len(ids))
    assert sched.update_draft_token_ids(dict(zip(ids, spec_tokens))) == len(ids)
    for rid in ids:
        assert sched.num_computed_tokens(rid) == 1
        assert len(sched.all_token_ids(rid)) == 2
    stats = sched.stats()
    assert stats["spec_num_drafts"] == stats["spec_num_draft_tokens"] == 0

    out = schedule(sched)
    assert list(out.scheduled_new_reqs) == []
    assert out.total_num_scheduled_tokens == len(ids) + sum(len(t) for t in spec_tokens)
    for rid, drafts in zip(ids, spec_tokens):
        assert out.num_scheduled_tokens[rid] == 1 + len(drafts)
        if drafts:
            assert out.scheduled_spec_decode_tokens[rid] == drafts
        else:
            assert rid not in out.scheduled_spec_decode_tokens
    apply(sched, out, output_tokens)
    stats = sched.stats()
    got = (
        stats["spec_num_drafts"],
        stats["spec_num_draft_tokens"],
        stats["spec_num_accepted_tokens"],
        list(stats["spec_num_accepted_tokens_per_pos"]),
    )
    assert got == (*expected[:3], expected[3] + [0] * (k - len(expected[3])))
    # Rejected drafts are rolled back: computed == num_tokens - 1 (invariant 22).
    for rid, sampled in zip(ids, output_tokens):
        assert len(sched.all_token_ids(rid)) == 2 + len(sampled)
        assert sched.num_computed_tokens(rid) == 1 + len(sampled)


def test_spec_decoding_stats_empty_output() -> None:
    """An empty sampled list for a request with drafts is refused (issue 16, defect 4: vLLM
    skips the rollback and leaves num_computed_tokens past the tokens), counting nothing."""
    sched = make_scheduler(method="ngram", k=2)
    sched.add_request(Request("a", [1], 8))
    out = schedule(sched)
    apply(sched, out, [[0]])
    sched.update_draft_token_ids({"a": [1, 2]})
    out = schedule(sched)
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}
    with pytest.raises(InvalidArgumentError, match="sampled no token"):
        sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[]]))
    stats = sched.stats()
    assert stats["spec_num_drafts"] == 0 and stats["spec_num_accepted_tokens"] == 0
    assert stats["spec_num_accepted_tokens_per_pos"] == [0, 0]
    assert sched.all_token_ids("a") == [1, 0]
    apply(sched, out, [[1, 9]])
    assert sched.stats()["spec_num_accepted_tokens"] == 1


@pytest.mark.parametrize("delivery", ["runner", "dict", "arrays"])
@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_no_spec_tokens_scheduled_for_prefill_chunks(method: str, delivery: str) -> None:
    """Budget 50, 80-token prompt: 50, then exactly 30 (drafts given mid-prefill are dropped),
    then 1 + 3."""
    k = 3
    sched = make_scheduler(method=method, k=k, max_num_batched_tokens=50)
    sched.add_request(Request("a", list(range(80)), 16))

    def deliver(out: Any, sampled: List[List[int]], drafts: List[int]) -> int:
        if delivery == "runner":
            apply(sched, out, sampled, draft_token_ids=[drafts])
            return -1
        apply(sched, out, sampled)
        if delivery == "dict":
            return sched.update_draft_token_ids({"a": drafts})
        return sched.update_draft_token_ids_from_arrays(
            out, np.array(drafts, dtype=np.int64), np.array([len(drafts)], dtype=np.int32)
        )

    out = schedule(sched)
    assert out.num_scheduled_tokens == {"a": 50}
    assert out.is_prefill_chunk.tolist() == [True]
    assert deliver(out, [[]], [1, 2, 3]) in (-1, 0)  # ignored: still a prefill chunk

    out = schedule(sched)
    assert out.num_scheduled_tokens == {"a": 30}
    assert out.scheduled_spec_decode_tokens == {}
    assert out.is_prefill_chunk.tolist() == [False]
    assert deliver(out, [[0]], [1, 2, 3]) in (-1, 1)

    out = schedule(sched)
    assert out.num_scheduled_tokens == {"a": 1 + k}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}


def test_token_for_a_prefill_chunk_is_discarded() -> None:
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(Request("a", list(range(12)), 4))
    out = schedule(sched)
    assert apply(sched, out, [[99]]) == []
    assert sched.all_token_ids("a") == list(range(12))
    out = schedule(sched)
    assert [r.new_token_ids for r in apply(sched, out, [[5]])] == [[5]]


def test_drafts_are_trimmed_by_max_model_len_budget_and_threshold() -> None:
    """num_new = min(1 + drafts, budget, threshold, max_model_len - 1 - num_computed); the
    scheduled drafts are the first num_new - 1."""

    def second_step(**kw: Any) -> Any:
        sched = make_scheduler(method="dflash", k=5, **kw)
        sched.add_request(Request("a", list(range(16)), 50))
        out = schedule(sched)
        apply(sched, out, [[0]] if not out.is_prefill_chunk[0] else [[]])
        while sched.num_computed_tokens("a") < 16:
            out = schedule(sched)
            apply(sched, out, one_token_each(out))
        sched.update_draft_token_ids({"a": [1, 2, 3, 4, 5]})
        return sched, schedule(sched)

    _, out = second_step()
    assert out.num_scheduled_tokens == {"a": 6}
    # max_model_len 20: positions up to 18 only -> 20 - 1 - 16 = 3 tokens, 2 drafts.
    sched, out = second_step(max_model_len=20)
    assert out.num_scheduled_tokens == {"a": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2]}
    # Lookahead is capped at max_model_len: 20 positions = 2 blocks of 16.
    assert len(sched.block_ids("a")) == 2
    _, out = second_step(max_num_batched_tokens=4)
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    _, out = second_step(long_prefill_token_threshold=2)
    assert out.num_scheduled_tokens == {"a": 2}
    assert out.scheduled_spec_decode_tokens == {"a": [1]}


def test_rejected_drafts_roll_back_computed_but_keep_blocks() -> None:
    sched = make_scheduler(method="dflash", k=8, block_size=4)
    sched.add_request(Request("a", list(range(6)), 50))
    out = schedule(sched)
    apply(sched, out, [[0]])
    sched.update_draft_token_ids({"a": list(range(8))})
    out = schedule(sched)
    assert out.num_scheduled_tokens == {"a": 9}
    blocks = sched.block_ids("a")
    # 7 tokens + 8 drafts + 9 lookahead -> 24 positions -> 6 blocks of 4.
    assert len(blocks) == 6
    apply(sched, out, [[0, 1, 77]])  # 2 of 8 accepted
    assert sched.num_computed_tokens("a") == 9
    assert len(sched.all_token_ids("a")) == 10
    assert sched.block_ids("a") == blocks


@pytest.mark.parametrize("prompt_len,expected_blocks", [(16, 2), (13, 2), (12, 1), (11, 1)])
def test_dflash_prefill_reserves_lookahead_blocks(prompt_len: int, expected_blocks: int) -> None:
    """K=3, block 16, 8-block pool, caching off: lookahead 4 on the very first step; a 16-token
    prompt owns 2 blocks (its query window is positions 16..19), a 13-token one too (13..16)."""
    sched = make_scheduler(8, method="dflash", k=3, block_size=16, enable_prefix_caching=False)
    sched.add_request(Request("a", list(range(prompt_len)), 4))
    out = schedule(sched)
    assert out.num_lookahead_tokens == 4
    assert sched.lookahead_tokens == sched.required_lookahead_tokens == 4
    assert len(sched.block_ids("a")) == expected_blocks
    # Every query position prompt_len .. prompt_len + 3 lies in an owned block.
    assert (prompt_len + 3) // 16 < len(out.scheduled_new_reqs[0].block_ids)


@pytest.mark.parametrize(
    "method,expected",
    [
        ("dflash", 9),
        ("eagle", 8),
        ("eagle3", 8),
        ("mtp", 8),
        ("draft_model", 8),
        ("ngram", 0),
        ("suffix", 0),
        (None, 0),
    ],
)
def test_lookahead_table(method: Optional[str], expected: int) -> None:
    k = 0 if method is None else 8
    sched = make_scheduler(method=method, k=k)
    assert sched.lookahead_tokens == sched.required_lookahead_tokens == expected
    assert sched.stats()["lookahead_tokens"] == expected
    legacy_k = make_scheduler(method=method, k=k, lookahead_policy="legacy-k")
    assert legacy_k.required_lookahead_tokens == expected
    assert legacy_k.lookahead_tokens == (8 if method == "dflash" else expected)
    # legacy-first-prefill only differs on admission; running requests get the full value.
    first = make_scheduler(method=method, k=k, lookahead_policy="legacy-first-prefill")
    assert first.lookahead_tokens == expected


# ---------------------------------------------------------------------------------------------
# leaks, block table, finished ids


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("method", ALL_METHODS)
def test_memory_leak(method: Optional[str], enable_prefix_caching: bool) -> None:
    """Add one request per step, run until everything finishes: the scheduler and pool are
    empty again (every usable block free, no request anywhere)."""
    num_blocks = 200
    k = 0 if method is None else 4
    sched = make_scheduler(
        num_blocks, method=method, k=k, enable_prefix_caching=enable_prefix_caching
    )
    rng = random.Random(3)
    tracker = Tracker()
    drafts = "none" if method is None else "random"
    for req in make_requests(5, num_tokens=10, max_tokens=10):
        sched.add_request(req)
        run_step(sched, rng, tracker, k=k, drafts=drafts)
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        run_step(sched, rng, tracker, k=k, drafts=drafts)
    out = schedule(sched)  # flushes the last finished ids
    tracker.on_schedule(out)
    apply(sched, out, [])
    assert tracker.reported_finished == {str(i) for i in range(5)}
    assert all(len(v) == 10 for v in tracker.outputs.values()), tracker.outputs
    assert_scheduler_empty(sched, num_blocks)


def test_block_table_rows_follow_the_batch() -> None:
    """Rows are re-laid every step: row i is req_ids[i]'s blocks, zeros past the count, also
    after requests finish and new ones take their place."""
    sched = make_scheduler(64, block_size=4, method="dflash", k=2)
    rng = random.Random(5)
    tracker = Tracker()
    for i, n in enumerate([5, 9, 3]):
        sched.add_request(Request(f"a{i}", [i] * n, 30))
    run_step(sched, rng, tracker, k=2, drafts="random")
    sched.finish_requests(["a1"])
    tracker.on_finish_requests(["a1"], "abort")
    step = run_step(sched, rng, tracker, k=2, drafts="random")
    assert list(step.out.req_ids) == ["a0", "a2"]
    sched.add_request(Request("b", [7] * 21, 30))
    for _ in range(6):
        step = run_step(sched, rng, tracker, k=2, drafts="random")
    assert set(step.out.req_ids) == {"a0", "a2", "b"}
    table = step.out.block_table
    with pytest.raises(ValueError):
        table[0, 0] = 123  # read-only view
    snapshot = table.copy()
    assert (snapshot == step.out.block_table).all()


def test_finished_ids_reported_exactly_once() -> None:
    """Stops, length caps, aborts of running and of waiting requests: each id shows up in the
    next SchedulerOutput's finished_req_ids, once."""
    sched = make_scheduler(max_num_seqs=4)
    sched.add_request(Request("eos", [1, 2], 10, eos_token_id=3))
    sched.add_request(Request("abort", [1, 2], 10))
    sched.add_request(Request("len", [1, 2], 1))
    sched.add_request(Request("live", [1, 2], 10))
    sched.add_request(Request("waiting-abort", [1, 2], 10))
    out = schedule(sched)
    assert list(out.req_ids) == ["eos", "abort", "len", "live"]
    assert sched.finish_requests(["waiting-abort"]) == ["waiting-abort"]
    results = apply(sched, out, [[3], [0], [0], [0]])
    finished = {r.request_id: r.finish_reason for r in results if r.finished}
    assert finished == {"eos": "stop", "len": "length"}
    assert sched.finish_requests(["abort", "eos", "unknown"]) == ["abort"]
    out = schedule(sched)
    assert out.finished_req_ids == {"eos", "len", "abort", "waiting-abort"}
    assert list(out.req_ids) == ["live"]
    apply(sched, out, one_token_each(out))
    for _ in range(3):
        out = schedule(sched)
        assert out.finished_req_ids == set()
        apply(sched, out, one_token_each(out))


# ---------------------------------------------------------------------------------------------
# priority scheduling


def prio_scheduler(num_blocks: int = 1000, **kw: Any) -> Scheduler:
    return make_scheduler(num_blocks, policy="priority", **kw)


def prio_requests(
    priorities: Sequence[int], arrival_times: Sequence[float], num_tokens: int = 10, start: int = 0
) -> List[Request]:
    return [
        Request(str(start + i), [start + i] * num_tokens, 16, priority=p, arrival_time=t)
        for i, (p, t) in enumerate(zip(priorities, arrival_times))
    ]


@pytest.mark.parametrize(
    "priorities,arrival_times,expected",
    [
        ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),  # basic ordering
        ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),  # arrival-time tie-break
        ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),  # mixed
        ([0, 0, 0, 0], [1.0, 2.0, 3.0, 4.0], ["0", "1", "2", "3"]),  # FCFS fallback
    ],
)
def test_priority_scheduling_ordering(
    priorities: List[int], arrival_times: List[float], expected: List[str]
) -> None:
    sched = prio_scheduler()
    for req in prio_requests(priorities, arrival_times):
        sched.add_request(req)
    assert sched.waiting_request_ids() == expected
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == expected
    assert list(out.req_ids) == expected


def test_priority_scheduling_with_limited_slots() -> None:
    sched = prio_scheduler(max_num_seqs=2)
    for req in prio_requests([3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0]):
        sched.add_request(req)
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["3", "1"]
    assert sched.get_request_counts() == (2, 2)
    assert sched.waiting_request_ids() == ["2", "0"]


def test_priority_scheduling_heap_property() -> None:
    """One request at a time: requests run in priority order whatever the insertion order."""
    sched = prio_scheduler(max_num_seqs=1)
    priorities = [5, 1, 8, 3, 2, 7, 4, 6]
    requests = prio_requests(priorities, [float(i) for i in range(len(priorities))])
    for req in requests:
        sched.add_request(req)
    order = []
    while sched.waiting_request_ids():
        out = schedule(sched)
        assert len(out.scheduled_new_reqs) == 1
        rid = out.scheduled_new_reqs[0].req_id
        order.append(requests[int(rid)].priority)
        apply(sched, out, [[100]])
        sched.finish_requests(rid, "stop")
    assert order == sorted(priorities)


def test_priority_scheduling_victim_order_in_waiting_queue() -> None:
    sched = prio_scheduler(max_num_seqs=1)
    for req in prio_requests([3, 2, 0], [1.0, 2.0, 3.0]):
        sched.add_request(req)
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["2"]
    assert sched.waiting_request_ids() == ["1", "0"]


def test_priority_scheduling_no_preemption_when_space_available() -> None:
    sched = prio_scheduler(max_num_seqs=3, max_num_batched_tokens=200)
    low = prio_requests([5, 5], [1.0, 2.0], num_tokens=30)
    for req in low:
        sched.add_request(req)
    out = schedule(sched)
    apply(sched, out, [[100], [100]])
    sched.add_request(prio_requests([0], [3.0], num_tokens=30, start=2)[0])
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["2"]
    assert out.preempted_req_ids == set()
    assert sched.get_request_counts() == (3, 0)


@pytest.mark.parametrize(
    "policy,keys,victim",
    [
        # lowest priority is preempted although it is first in the running list
        ("priority", {"x": (9, 1.0), "y": (0, 2.0), "z": (5, 3.0)}, "x"),
        # equal priorities: the latest arrival is preempted
        ("priority", {"x": (0, 5.0), "y": (0, 1.0), "z": (0, 2.0)}, "x"),
        # FCFS: the last running request, whatever the priorities
        ("fcfs", {"x": (9, 1.0), "y": (0, 2.0), "z": (5, 3.0)}, "z"),
    ],
)
def test_preemption_victim(policy: str, keys: Dict[str, tuple], victim: str) -> None:
    """6 usable blocks of 16. "x" (20 tokens) runs first; "y" (32) and "z" (20) join; running
    order is [x, y, z] and the pool is full. After one token each, "y" needs a 3rd block."""
    sched = make_scheduler(7, block_size=16, policy=policy, max_num_batched_tokens=200)
    sizes = {"x": 20, "y": 32, "z": 20}

    def req(rid: str) -> Request:
        p, t = keys[rid]
        return Request(rid, [ord(rid)] * sizes[rid], 16, priority=p, arrival_time=t)

    sched.add_request(req("x"))
    out = schedule(sched)
    apply(sched, out, [[1]])
    sched.add_request(req("y"))
    sched.add_request(req("z"))
    out = schedule(sched)
    assert list(out.req_ids) == ["x", "y", "z"] and sched.num_free_blocks == 0
    apply(sched, out, [[1], [1], [1]])

    out = schedule(sched)
    assert out.preempted_req_ids == {victim}
    survivors = [r for r in ["x", "y", "z"] if r != victim]
    # Batch order is the block table's row order (rows move into holes), not running order.
    assert sorted(out.req_ids) == survivors
    assert out.num_scheduled_tokens == {r: 1 for r in survivors}
    assert sched.running_request_ids() == survivors
    assert sched.request_status(victim) == "preempted"
    assert sched.waiting_request_ids() == [victim]
    assert len(sched.block_ids("y")) == 3


def test_priority_preempts_a_skipped_request_and_keeps_the_cursor() -> None:
    """Invariant 24 (fixed after 0.23): the victim "a" sits before the cursor but was skipped
    this step (its last output brought no token); removing it must not make the scheduler skip
    "c", the request after the one that needed the block."""
    sched = prio_scheduler(5, block_size=16, max_num_batched_tokens=200)
    sched.add_request(Request("a", [1] * 8, 16, priority=9, arrival_time=0.0))
    out = schedule(sched)
    apply(sched, out, [[5]])
    sched.add_request(Request("b", [2] * 32, 16, priority=0, arrival_time=1.0))
    sched.add_request(Request("c", [3] * 8, 16, priority=1, arrival_time=2.0))
    out = schedule(sched)
    assert list(out.req_ids) == ["a", "b", "c"] and sched.num_free_blocks == 0
    apply(sched, out, [[], [5], [5]])  # "a" got no token: nothing to compute next step

    out = schedule(sched)
    assert out.preempted_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 1, "c": 1}


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_priority_scheduling_preemption_and_resumption_when_out_of_kv(
    enable_prefix_caching: bool,
) -> None:
    """4 usable blocks. "low" (30 tokens) runs, "high" (32) joins; after two tokens "high" needs
    a 3rd block: "low" (already scheduled this step) is unscheduled and preempted. When "high"
    finishes, "low" resumes with all 32 of its tokens."""
    sched = prio_scheduler(
        5,
        block_size=16,
        max_num_seqs=2,
        max_num_batched_tokens=200,
        enable_prefix_caching=enable_prefix_caching,
    )
    low = Request("low", list(range(30)), 16, priority=1, arrival_time=0.0)
    sched.add_request(low)
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["low"]
    apply(sched, out, [[100]])

    sched.add_request(Request("high", list(range(50, 82)), 16, priority=0, arrival_time=1.0))
    out = schedule(sched)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["high"]
    assert sched.get_request_counts() == (2, 0)
    apply(sched, out, [[100], [100]])

    out = schedule(sched)
    assert list(out.scheduled_new_reqs) == []
    assert out.scheduled_cached_reqs.req_ids == ["high"]
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert sched.request_status("low") == "preempted"
    assert sched.get_request_counts() == (1, 1)
    apply(sched, out, [[100]])
    sched.finish_requests("high", "stop")

    out = schedule(sched)
    assert sched.get_request_counts() == (1, 0)
    cached = out.scheduled_cached_reqs
    assert list(cached.req_ids) == ["low"] and cached.resumed_req_ids == {"low"}
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "low" and new.resumed
    assert new.all_token_ids == [*range(30), 100, 100]
    assert new.prompt_token_ids == list(range(30))
    assert (
        cached.new_block_ids == [sched.block_ids("low")]
        and new.block_ids == cached.new_block_ids[0]
    )
    hits = 16 if enable_prefix_caching else 0
    assert new.num_computed_tokens == hits
    assert out.num_scheduled_tokens == {"low": 32 - hits}
    assert out.finished_req_ids == {"high"}
    (result,) = apply(sched, out, [[7]])
    assert result.new_token_ids == [7]
    assert sched.all_token_ids("low") == [*range(30), 100, 100, 7]


def test_max_num_seqs_limits_admission() -> None:
    sched = make_scheduler(max_num_seqs=3)
    for req in make_requests(5):
        sched.add_request(req)
    out = schedule(sched)
    assert list(out.req_ids) == ["0", "1", "2"]
    assert sched.waiting_request_ids() == ["3", "4"]
    apply(sched, out, [[1]] * 3)
    sched.finish_requests(["1"])
    out = schedule(sched)
    assert list(out.req_ids) == ["0", "2", "3"]


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_kv_usage_and_free_blocks_agree(method: str) -> None:
    num_blocks = 41
    sched = make_scheduler(num_blocks, method=method, k=3, block_size=4)
    rng = random.Random(11)
    for req in make_requests(4, num_tokens=7, max_tokens=6):
        sched.add_request(req)
    for _ in range(8):
        run_step(sched, rng, k=3, drafts="random")
        held = {b for rid in sched.running_request_ids() for b in sched.block_ids(rid)}
        assert sched.num_free_blocks == num_blocks - 1 - len(held)
        assert sched.kv_cache_usage == pytest.approx(len(held) / (num_blocks - 1))
