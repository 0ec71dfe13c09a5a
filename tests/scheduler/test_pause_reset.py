"""Pause states and resets with running requests (vLLM 0.33's ``set_pause_state`` and
``reset_prefix_cache(reset_running_requests=True)``) through the Python API.

``reset_prefix_cache(reset_running_requests=True)`` preempts every running request in reverse
running order (they head the waiting queue in running order) and drops the output of their steps
already scheduled: when it arrives it yields nothing (no tokens, no stats), and they resume at
once. ``preempt_all_running(drop_stale_outputs=False)`` is an ordinary preemption of all: the
stale output is delivered and awaited. ``set_pause_state("paused_new")`` schedules running
requests only; ``"paused_all"`` schedules nothing but still reports finished and preempted ids.

Every call goes through ``Checked``, which runs ``check_invariants()`` after it; bad arguments
raise a typed error and change nothing.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, List, Optional

import numpy as np
import pytest

from dflash_rs import (
    InvalidArgumentError,
    InvariantError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
    _core,
)

from .bad_input import snapshot
from .drivers import check_block_table, check_step_arrays, ownership_violations, required_lookahead

BS = 16


class Checked:
    """A Scheduler whose every call is followed by ``check_invariants()``."""

    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        sched.check_invariants()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.s, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            finally:
                self.s.check_invariants()

        return call


def make(
    method: Optional[str] = None, k: int = 0, *, async_scheduling: bool = False, **kw: Any
) -> Checked:
    kw.setdefault("num_blocks", 200)
    cfg = SchedulerConfig(
        speculative=None if method is None else SpeculativeConfig(method, k),
        block_size=BS,
        max_model_len=256,
        async_scheduling=async_scheduling,
        **kw,
    )
    return Checked(Scheduler(cfg))


def prompt(i: int, n: int) -> List[int]:
    return [100 * (i + 1) + t for t in range(n)]


def add(s: Checked, *ids: str, n: int = 20, max_tokens: int = 50) -> None:
    for rid in ids:
        i = s.get_num_unfinished_requests()
        s.add_request(Request(rid, prompt(i, n + i), max_tokens, arrival_time=float(i)))


def schedule(s: Checked) -> Any:
    out = s.schedule()
    check_block_table(s.s, out)
    if not s.config.async_scheduling:  # (its computed-token checks assume sync mode)
        check_step_arrays(s.s, out)
    cfg = s.config
    lookahead = required_lookahead(
        cfg.speculative and cfg.speculative.method, cfg.num_speculative_tokens
    )
    assert not ownership_violations(
        s.s, out, lookahead=lookahead, block_size=BS, max_model_len=cfg.max_model_len
    )
    return out


def sampled(out: Any, token: int = 50, accept: int = 0) -> List[List[int]]:
    """Per entry: [] for prefill chunks, else ``accept`` drafts (capped) and a bonus token."""
    result = []
    for rid, chunk in zip(out.req_ids, out.is_prefill_chunk):
        n = len(out.scheduled_spec_decode_tokens.get(rid, []))
        result.append([] if chunk else [token + 1] * min(accept, n) + [token])
    return result


def apply(
    s: Checked, out: Any, tokens: Optional[List[List[int]]] = None, arrays: bool = False
) -> Any:
    tokens = sampled(out) if tokens is None else tokens
    if arrays:
        flat = np.array([t for x in tokens for t in x], dtype=np.int32)
        counts = np.array([len(x) for x in tokens], dtype=np.int32)
        return s.update_from_output_arrays(
            out, ModelRunnerOutput.from_arrays(list(out.req_ids), flat, counts)
        )
    return s.update_from_output(out, ModelRunnerOutput(out.req_ids, tokens))


def decoding(s: Checked, *ids: str) -> None:
    """Adds ``ids`` and runs one synchronous step: all of them past their prefill."""
    add(s, *ids)
    out = schedule(s)
    assert sorted(out.req_ids) == sorted(ids)
    apply(s, out)


def spec_stats(s: Checked) -> tuple:
    st = s.stats()
    return (
        st["spec_num_drafts"],
        st["spec_num_draft_tokens"],
        st["spec_num_accepted_tokens"],
        list(st["spec_num_accepted_tokens_per_pos"]),
    )


# ------------------------------------------------------------------------------------------
# reset_prefix_cache(reset_running_requests=True)


def test_reset_without_running_requests_keeps_its_old_meaning() -> None:
    s = make()
    assert s.reset_prefix_cache() is True
    decoding(s, "a")
    assert s.reset_prefix_cache() is False  # a holds blocks
    assert s.reset_prefix_cache(False) is False
    assert s.request_status("a") == "running"


def test_reset_preempts_in_reverse_order_and_resumes_in_fifo_order() -> None:
    s = make("dflash", 3)
    decoding(s, "a", "b", "c")
    add(s, "w", max_tokens=3)
    assert s.running_request_ids() == ["a", "b", "c"]
    before = {rid: s.all_token_ids(rid) for rid in "abc"}
    assert s.reset_prefix_cache(reset_running_requests=True) is True
    assert s.running_request_ids() == []
    assert s.waiting_request_ids() == ["a", "b", "c", "w"]
    assert s.num_free_blocks == 199 and s.kv_cache_usage == 0.0
    assert s.stats()["num_preemptions"] == 3
    for rid in "abc":
        assert s.request_status(rid) == "preempted"
        assert s.num_computed_tokens(rid) == 0
        assert s.all_token_ids(rid) == before[rid]  # outputs kept, recomputed on resume
    out = schedule(s)
    assert out.preempted_req_ids == {"a", "b", "c"}
    # The prefix cache is empty: everything is recomputed, admitted in FIFO order.
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b", "c", "w"]
    assert all(r.num_computed_tokens == 0 for r in out.scheduled_new_reqs)
    assert out.scheduled_cached_reqs.resumed_req_ids == {"a", "b", "c"}
    apply(s, out)
    assert schedule(s).preempted_req_ids == set()  # reported once


@pytest.mark.parametrize("arrays", [False, True])
def test_sync_step_in_flight_at_reset_yields_nothing(arrays: bool) -> None:
    s = make("dflash", 3)
    decoding(s, "a", "b")
    s.update_draft_token_ids({"a": [7, 8, 9]})
    pending = schedule(s)
    assert pending.scheduled_spec_decode_tokens == {"a": [7, 8, 9]}
    tokens = {rid: s.all_token_ids(rid) for rid in "ab"}
    stats = spec_stats(s)
    s.reset_prefix_cache(reset_running_requests=True)
    resumed = schedule(s)  # not held back by the output still in flight
    assert set(resumed.req_ids) == {"a", "b"}
    result = apply(s, pending, sampled(pending, accept=2), arrays=arrays)
    assert len(result) == 0
    assert {rid: s.all_token_ids(rid) for rid in "ab"} == tokens
    assert spec_stats(s) == stats  # the three drafts were never verified, as far as stats go
    result = apply(s, resumed, arrays=arrays)
    assert len(result) == 2
    assert s.all_token_ids("a") == tokens["a"] + [50]


def test_async_steps_in_flight_at_reset_yield_nothing() -> None:
    s = make("eagle", 2, async_scheduling=True)
    add(s, "a", "b", "c")
    queue = deque([schedule(s), schedule(s)])
    apply(s, queue.popleft())
    queue.append(schedule(s))
    assert s.num_output_placeholders("a") == 2 * 3
    tokens = {rid: s.all_token_ids(rid) for rid in "abc"}
    stats = spec_stats(s)
    s.reset_prefix_cache(reset_running_requests=True)
    for rid in "abc":
        assert s.num_output_placeholders(rid) == 0 and s.num_computed_tokens(rid) == 0
    resumed = schedule(s)
    assert resumed.num_scheduled_tokens == {rid: len(t) for rid, t in tokens.items()}
    while queue:
        out = queue.popleft()
        assert apply(s, out, sampled(out, accept=2)) == []
    assert {rid: s.all_token_ids(rid) for rid in "abc"} == tokens
    assert spec_stats(s) == stats
    for rid in "abc":
        assert s.num_output_placeholders(rid) == 1  # the resume's sampled token only
    assert len(apply(s, resumed)) == 3
    assert s.all_token_ids("a") == tokens["a"] + [50]


def test_dropped_entry_may_sample_nothing_under_async_scheduling() -> None:
    s = make("ngram", 3, async_scheduling=True)
    add(s, "a")
    out = schedule(s)
    s.reset_prefix_cache(reset_running_requests=True)
    assert apply(s, out, [[]]) == []


def test_without_drop_the_stale_output_is_delivered() -> None:
    s = make()
    decoding(s, "a", "b")
    pending = schedule(s)
    assert s.preempt_all_running(drop_stale_outputs=False) == ["b", "a"]
    assert s.waiting_request_ids() == ["a", "b"]
    held = schedule(s)  # waiting for their stale output
    assert list(held.req_ids) == [] and held.preempted_req_ids == {"a", "b"}
    result = apply(s, pending)
    assert sorted(r.request_id for r in result) == ["a", "b"]
    assert apply(s, held) == []
    assert s.num_computed_tokens("a") == 0 and len(s.all_token_ids("a")) == 22
    assert sorted(schedule(s).req_ids) == ["a", "b"]


def test_preempt_all_running_with_drop_keeps_the_cache() -> None:
    s = make()
    decoding(s, "a")
    assert s.preempt_all_running(drop_stale_outputs=True) == ["a"]
    out = schedule(s)
    # The prefix cache still holds a's full blocks: a resumes on a prefix hit.
    assert out.scheduled_new_reqs[0].num_computed_tokens == BS
    assert out.preempted_req_ids == {"a"}


def test_a_request_aborted_after_the_reset_is_reported_finished_and_preempted() -> None:
    s = make()
    decoding(s, "a", "b")
    s.reset_prefix_cache(reset_running_requests=True)
    assert s.finish_requests("a") == ["a"]
    out = schedule(s)
    assert out.finished_req_ids == {"a"} and out.preempted_req_ids == {"a", "b"}
    assert list(out.req_ids) == ["b"]


# ------------------------------------------------------------------------------------------
# pause states


def test_paused_new_runs_running_requests_only() -> None:
    s = make("dflash", 3)
    decoding(s, "a")
    add(s, "new")
    assert s.pause_state == "unpaused"
    s.set_pause_state("paused_new")
    assert s.pause_state == "paused_new"
    for _ in range(3):
        out = schedule(s)
        assert list(out.req_ids) == ["a"]
        apply(s, out)
    assert s.waiting_request_ids() == ["new"]
    # Preempted requests wait in the same queue: not resumed while paused.
    s.preempt_all_running(drop_stale_outputs=False)
    out = schedule(s)
    assert list(out.req_ids) == [] and out.preempted_req_ids == {"a"}
    apply(s, out)
    s.set_pause_state("unpaused")
    assert list(schedule(s).req_ids) == ["a", "new"]


def test_paused_all_schedules_nothing_but_reports_ids() -> None:
    s = make(async_scheduling=True)
    add(s, "a", "b", "c")
    first = schedule(s)
    s.set_pause_state("paused_all")
    out = schedule(s)
    assert list(out.req_ids) == [] and out.total_num_scheduled_tokens == 0
    assert len(apply(s, first)) == 3  # the step in flight still applies
    apply(s, out)
    s.finish_requests(["b"])
    s.reset_prefix_cache(reset_running_requests=True)
    out = schedule(s)
    assert list(out.req_ids) == []
    assert out.finished_req_ids == {"b"} and out.preempted_req_ids == {"a", "c"}
    apply(s, out)
    s.set_pause_state("unpaused")
    assert list(schedule(s).req_ids) == ["a", "c"]


# ------------------------------------------------------------------------------------------
# bad arguments


@pytest.mark.parametrize(
    "call, fragment",
    [
        (lambda s: s.reset_prefix_cache(1), "reset_running_requests must be a bool, got int"),
        (
            lambda s: s.reset_prefix_cache(reset_running_requests="yes"),
            "reset_running_requests must be a bool, got str",
        ),
        (
            lambda s: s.preempt_all_running(drop_stale_outputs=0),
            "drop_stale_outputs must be a bool, got int",
        ),
        (lambda s: s.set_pause_state("paused"), 'got "paused"'),
        (lambda s: s.set_pause_state("PAUSED_NEW"), '"paused_new"'),
        (lambda s: s.set_pause_state(1), '"unpaused", "paused_new" or "paused_all"'),
    ],
)
def test_bad_arguments_raise_typed_errors_and_change_nothing(
    call: Callable[[Any], Any], fragment: str
) -> None:
    s = make("dflash", 3)
    decoding(s, "a", "b")
    add(s, "w")
    s.set_pause_state("paused_new")
    before = snapshot(s.s)
    with pytest.raises(InvalidArgumentError) as info:
        call(s)
    assert fragment in str(info.value)
    assert snapshot(s.s) == before
    assert s.pause_state == "paused_new"


def test_drop_stale_outputs_is_a_required_keyword() -> None:
    s = make()
    with pytest.raises(TypeError):
        s.preempt_all_running()  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        s.preempt_all_running(True)  # type: ignore[misc]


@pytest.mark.skipif(
    getattr(_core, "_inject_fault", None) is None,
    reason="built without the fault-injection feature (a release wheel)",
)
def test_internal_error_in_preempt_all_raises_and_keeps_state() -> None:
    inject = _core._inject_fault
    s = make()
    decoding(s, "a", "b")
    before = snapshot(s.s)
    inject("preempt_all.begin", "error")
    try:
        with pytest.raises(InvariantError, match=r"injected fault at preempt_all\.begin"):
            s.reset_prefix_cache(reset_running_requests=True)
    finally:
        inject("preempt_all.begin", "off")
    assert snapshot(s.s) == before
    assert s.reset_prefix_cache(reset_running_requests=True)
