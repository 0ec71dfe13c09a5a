"""A step's output reads the same for as long as the caller holds it, whatever the scheduler does
meanwhile (issue 16, defects 1 and 2): later steps, finishes, aborts, preemption, a prefix-cache
reset. Every test snapshots what an output exposes right after ``schedule()`` and compares it
after each later call."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import dflash_rs as d
from dflash_rs.errors import InvalidArgumentError


def expected_table(sched: d.Scheduler, out: Any) -> tuple[np.ndarray, np.ndarray]:
    """What `out.block_table` and `out.num_blocks_per_row` must read, from the blocks each
    request owns now (call it right after schedule()), without reading them."""
    cfg = sched.config
    width = -(-cfg.max_model_len // cfg.block_size)
    table = np.zeros((len(out.req_ids), width), dtype=np.int32)
    counts = np.zeros(len(out.req_ids), dtype=np.int32)
    for i, rid in enumerate(out.req_ids):
        blocks = sched.block_ids(rid)
        table[i, : len(blocks)] = blocks
        counts[i] = len(blocks)
    return table, counts


def frozen_view(out: Any, sched: d.Scheduler | None = None) -> dict[str, Any]:
    """Deep copies of everything `out` exposes. With `sched`, the block table is not read:
    what it must read comes from the blocks the requests own (so its first read can come
    later, after the scheduler changed its own table)."""
    cached = out.scheduled_cached_reqs
    if sched is None:
        table = np.array(out.block_table, copy=True)
        counts = np.array(out.num_blocks_per_row, copy=True)
    else:
        table, counts = expected_table(sched, out)
    return {
        "req_ids": list(out.req_ids),
        "block_table": table,
        "num_blocks_per_row": counts,
        "num_scheduled_tokens_array": np.array(out.num_scheduled_tokens_array, copy=True),
        "num_computed_tokens": np.array(out.num_computed_tokens, copy=True),
        "query_start_loc": np.array(out.query_start_loc, copy=True),
        "is_prefill_chunk": np.array(out.is_prefill_chunk, copy=True),
        "num_spec_tokens_array": np.array(out.num_spec_tokens_array, copy=True),
        "num_output_placeholders": np.array(out.num_output_placeholders, copy=True),
        "num_scheduled_tokens": dict(out.num_scheduled_tokens),
        "scheduled_spec_decode_tokens": copy.deepcopy(out.scheduled_spec_decode_tokens),
        "finished_req_ids": set(out.finished_req_ids),
        "preempted_req_ids": set(out.preempted_req_ids),
        "new_reqs": [
            (n.req_id, list(n.block_ids), list(n.prompt_token_ids), n.num_computed_tokens)
            for n in out.scheduled_new_reqs
        ],
        "cached": (
            list(cached.req_ids),
            copy.deepcopy(cached.new_block_ids),
            list(cached.num_computed_tokens),
        ),
        "total": out.total_num_scheduled_tokens,
    }


def assert_unchanged(out: Any, expected: dict[str, Any], after: str) -> None:
    now = frozen_view(out)
    for key, value in expected.items():
        if isinstance(value, np.ndarray):
            assert np.array_equal(now[key], value), f"{key} of a held output changed after {after}"
        else:
            assert now[key] == value, f"{key} of a held output changed after {after}"


def dflash_scheduler(**overrides: Any) -> d.Scheduler:
    kwargs: dict[str, Any] = dict(
        num_blocks=64,
        max_model_len=256,
        speculative=d.SpeculativeConfig("dflash", 4),
        async_scheduling=True,
    )
    kwargs.update(overrides)
    return d.Scheduler(d.SchedulerConfig(**kwargs))


def sampled_for(out: Any, token: int = 3) -> d.ModelRunnerOutput:
    """One token per request that is past its prompt, none for prefill chunks."""
    lists = [[] if chunk else [token] for chunk in out.is_prefill_chunk.tolist()]
    return d.ModelRunnerOutput(list(out.req_ids), lists)


def test_the_issue_repro_an_abort_does_not_rewrite_the_in_flight_table() -> None:
    s = dflash_scheduler()
    s.add_request(d.Request("a", list(range(1, 16)), max_tokens=40))
    s.add_request(d.Request("b", list(range(100, 115)), max_tokens=40))
    out = s.schedule()
    expected = frozen_view(out)
    assert out.block_table[:, :2].tolist() == [[1, 2], [3, 4]]
    s.finish_requests("a")
    assert out.block_table[:, :2].tolist() == [[1, 2], [3, 4]]
    assert_unchanged(out, expected, "finish_requests")
    s.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_held_outputs_survive_later_steps_finishes_and_aborts(async_scheduling: bool) -> None:
    s = dflash_scheduler(async_scheduling=async_scheduling, num_blocks=128)
    for i in range(4):
        s.add_request(d.Request(f"r{i}", [10 + i] * (20 + 7 * i), max_tokens=30, eos_token_id=7))
    held: list[tuple[Any, dict[str, Any]]] = []
    pending: list[Any] = []
    for step in range(25):
        out = s.schedule()
        held.append((out, frozen_view(out)))
        pending.append(out)
        if len(pending) > (1 if async_scheduling else 0):
            done = pending.pop(0)
            token = 7 if step == 6 else 3  # every request finishes on EOS at step 6
            s.update_from_output(done, sampled_for(done, token))
        if step == 3:
            s.finish_requests("r2")
        if step == 8:
            for i in range(4, 7):
                s.add_request(d.Request(f"r{i}", [40 + i] * 33, max_tokens=12))
        for o, expected in held:
            assert_unchanged(o, expected, f"step {step}")
        s.check_invariants()


def test_preemption_and_reset_do_not_rewrite_held_tables() -> None:
    s = dflash_scheduler(num_blocks=24, async_scheduling=False, max_model_len=128)
    for i in range(3):
        s.add_request(d.Request(f"p{i}", [20 + i] * 30, max_tokens=60))
    held = []
    saw_preemption = False
    for step in range(40):
        out = s.schedule()
        held.append((out, frozen_view(out)))
        saw_preemption |= bool(out.preempted_req_ids)
        s.update_from_output(out, sampled_for(out))
        if step == 20:
            s.preempt_all_running(drop_stale_outputs=False)
            s.reset_prefix_cache()
        for o, expected in held:
            assert_unchanged(o, expected, f"step {step}")
    assert saw_preemption, "the pool is small enough to preempt"
    s.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_table_first_read_late_reads_as_when_the_step_was_returned(
    async_scheduling: bool,
) -> None:
    """The table is frozen at first read: a read many steps, finishes and aborts later still
    sees the step as it was returned (the scheduler keeps what it needs, or freezes it first)."""
    s = dflash_scheduler(async_scheduling=async_scheduling, num_blocks=128)
    for i in range(6):
        s.add_request(d.Request(f"r{i}", [10 + i] * (17 + 5 * i), max_tokens=60, eos_token_id=7))
    held = []
    pending: list[Any] = []
    for step in range(40):
        out = s.schedule()
        held.append((out, expected_table(s, out)))
        pending.append(out)
        if len(pending) > (1 if async_scheduling else 0):
            done = pending.pop(0)
            s.update_from_output(done, sampled_for(done, 7 if step % 9 == 8 else 3))
        if step == 5:
            s.finish_requests(["r1", "r4"])
        if step % 10 == 3:
            s.add_request(d.Request(f"late{step}", [50 + step] * 40, max_tokens=9))
    for out, (table, counts) in held[::-1]:  # newest first: forward and backward replays
        assert np.array_equal(out.block_table, table)
        assert np.array_equal(out.num_blocks_per_row, counts)
    s.check_invariants()


def test_rows_of_a_held_table_are_the_blocks_owned_when_it_was_returned() -> None:
    s = dflash_scheduler(async_scheduling=True)
    s.add_request(d.Request("a", list(range(1, 40)), max_tokens=40))
    s.add_request(d.Request("b", list(range(100, 140)), max_tokens=40))
    out = s.schedule()
    owned = {rid: s.block_ids(rid) for rid in out.req_ids}
    s.finish_requests(["a"])
    nxt = s.schedule()  # appends to b's row, moved to row 0
    s.update_from_output(out, sampled_for(out))
    for i, rid in enumerate(out.req_ids):
        n = int(out.num_blocks_per_row[i])
        assert out.block_table[i, :n].tolist() == owned[rid]
        assert not out.block_table[i, n:].any()
    assert list(nxt.req_ids) == ["b"]


def test_exposed_arrays_are_read_only() -> None:
    """Every array is read-only; the block table's two views (shared snapshots the scheduler
    reuses once released) cannot even be made writable."""
    s = dflash_scheduler()
    s.add_request(d.Request("a", [1] * 20, max_tokens=4))
    out = s.schedule()
    arrays = [
        out.block_table,
        out.num_blocks_per_row,
        out.num_scheduled_tokens_array,
        out.num_computed_tokens,
        out.query_start_loc,
        out.is_prefill_chunk,
        out.num_spec_tokens_array,
        out.num_output_placeholders,
    ]
    for arr in arrays:
        with pytest.raises(ValueError):
            arr[0] = 1
    for arr in (out.block_table, out.num_blocks_per_row, out.block_table[:, :1]):
        with pytest.raises(ValueError):
            arr.setflags(write=True)


def test_req_ids_cannot_be_changed_through_an_output() -> None:
    """Defect 2: `o1.req_ids.sort()` changed the previous output too, and handing that very
    list back made the scheduler give a's tokens to b."""
    s = d.Scheduler(d.SchedulerConfig(num_blocks=64, max_model_len=256))
    s.add_request(d.Request("b", [5] * 4, max_tokens=10))
    s.add_request(d.Request("a", [6] * 4, max_tokens=10))
    o0 = s.schedule()
    s.update_from_output(o0, d.ModelRunnerOutput(list(o0.req_ids), [[1], [2]]))
    o1 = s.schedule()
    assert o1.req_ids == ("b", "a")
    with pytest.raises(AttributeError):
        o1.req_ids.sort()  # type: ignore[attr-defined]
    assert o0.req_ids == ("b", "a")


def test_a_list_handed_back_is_checked_not_trusted_by_identity() -> None:
    s = d.Scheduler(d.SchedulerConfig(num_blocks=64, max_model_len=256))
    s.add_request(d.Request("b", [5] * 4, max_tokens=10))
    s.add_request(d.Request("a", [6] * 4, max_tokens=10))
    o0 = s.schedule()
    ids = list(o0.req_ids)
    runner = d.ModelRunnerOutput(ids, [[1], [2]])
    ids.sort()  # the runner's list changes after the output was built
    free = s.num_free_blocks
    with pytest.raises(InvalidArgumentError, match=r"req_ids\[0\] = a"):
        s.update_from_output(o0, runner)
    assert s.num_free_blocks == free and s.all_token_ids("b") == [5] * 4
    s.update_from_output(o0, d.ModelRunnerOutput(list(o0.req_ids), [[1], [2]]))
    assert s.all_token_ids("b") == [5] * 4 + [1]
    assert s.all_token_ids("a") == [6] * 4 + [2]


def test_containers_an_output_returns_are_fresh_so_the_output_reads_the_same() -> None:
    s = dflash_scheduler()
    s.add_request(d.Request("a", [1] * 20, max_tokens=4))
    out = s.schedule()
    out.num_scheduled_tokens["a"] = 99
    out.scheduled_spec_decode_tokens["a"] = [1, 2]
    out.scheduled_cached_reqs.req_ids.append("x")
    new = out.scheduled_new_reqs[0]
    new.block_ids.append(1234)
    new.prompt_token_ids.clear()
    assert out.num_scheduled_tokens == {"a": 20}
    assert out.scheduled_spec_decode_tokens == {}
    assert out.scheduled_cached_reqs.req_ids == []
    assert 1234 not in new.block_ids and new.prompt_token_ids == [1] * 20
    assert isinstance(out.scheduled_new_reqs, tuple)
    assert isinstance(out.finished_req_ids, frozenset)
    assert isinstance(out.preempted_req_ids, frozenset)
