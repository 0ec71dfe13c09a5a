"""``SchedulerOutput.req_ids`` is handed out again while a step's batch is unchanged (so a
steady decode step touches no string object) and rebuilt as soon as it changes: every step's
tuple holds exactly that step's batch, whoever else holds an earlier output."""

from __future__ import annotations

import numpy as np

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig


def _step(sched: Scheduler, finish: str | None = None) -> object:
    """One step that samples one token per request; `finish` samples EOS (7) for that id."""
    out = sched.schedule()
    counts = np.where(out.is_prefill_chunk, 0, 1).astype(np.int32)
    tokens = np.array(
        [7 if rid == finish else 3 for rid, c in zip(out.req_ids, counts) if c],
        dtype=np.int32,
    )
    sched.update_from_output(out, ModelRunnerOutput.from_arrays(out.req_ids, tokens, counts))
    return out


def test_req_ids_are_shared_while_the_batch_is_unchanged_and_rebuilt_when_it_changes() -> None:
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=64, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256
        )
    )
    for i in range(3):
        sched.add_request(Request(f"r{i}", [5] * 20, 50, eos_token_id=7))
    first = _step(sched)  # all three prefill in one step
    a = _step(sched)
    b = _step(sched)
    assert list(a.req_ids) == ["r0", "r1", "r2"]
    assert b.req_ids is a.req_ids, "an unchanged batch reuses the tuple"
    assert first.req_ids == a.req_ids

    _step(sched, finish="r1")  # r1 samples EOS and leaves
    c = _step(sched)
    assert c.req_ids is not a.req_ids
    assert sorted(c.req_ids) == ["r0", "r2"]
    assert list(a.req_ids) == ["r0", "r1", "r2"], "an earlier output keeps its batch"

    sched.add_request(Request("r3", [6] * 5, 50))
    d = _step(sched)
    assert sorted(d.req_ids) == ["r0", "r2", "r3"]
    for out in (c, d):
        assert len(out.req_ids) == out.num_reqs == len(out.num_scheduled_tokens_array)
    sched.check_invariants()
