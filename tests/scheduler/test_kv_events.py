"""``SchedulerConfig(kv_events=True)`` and ``Scheduler.take_kv_events()``: the prefix-cache
changes an engine publishes as KV-cache events (stored blocks with their request, logical
index, parent block and tokens; evicted registrations; resets)."""

from __future__ import annotations

import pytest

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from dflash_rs.errors import InvalidArgumentError


def _outputs_for(out, token: int = 9):
    return ModelRunnerOutput(out.req_ids, [[] if c else [token] for c in out.is_prefill_chunk])


def _config(**kwargs) -> SchedulerConfig:
    args = dict(num_blocks=8, block_size=16, max_model_len=112, kv_events=True)
    return SchedulerConfig(**{**args, **kwargs})


def test_off_by_default() -> None:
    sched = Scheduler(SchedulerConfig(num_blocks=8, block_size=16, max_model_len=112))
    sched.add_request(Request("a", list(range(40)), 2))
    sched.update_from_output(out := sched.schedule(), _outputs_for(out))
    assert sched.take_kv_events() == []


def test_kv_events_must_be_a_bool() -> None:
    with pytest.raises(InvalidArgumentError, match="kv_events"):
        _config(kv_events=1)


def test_stored_removed_cleared() -> None:
    sched = Scheduler(_config())
    prompt = list(range(100, 140))
    sched.add_request(Request("a", prompt, 2))
    out = sched.schedule()
    blocks = sched.block_ids("a")
    assert sched.take_kv_events() == [("stored", "a", 0, 0, blocks[:2], prompt[:32])]
    assert sched.take_kv_events() == [], "taken once"
    sched.update_from_output(out, _outputs_for(out))
    sched.finish_requests(["a"])
    # b takes every block: a's two cached ones are evicted when they are reused.
    sched.add_request(Request("b", list(range(500, 600)), 1))
    sched.schedule()
    events = sched.take_kv_events()
    assert sorted(e[1] for e in events if e[0] == "removed") == sorted(blocks[:2])
    assert events[-1][:4] == ("stored", "b", 0, 0)
    sched.finish_requests(["b"])
    assert sched.reset_prefix_cache()
    assert sched.take_kv_events() == [("cleared",)]


def test_undone_priority_victim_withdraws_its_blocks() -> None:
    """The core's one intended difference from vLLM shows in the events: a victim preempted in
    the step that scheduled it withdraws the blocks that step registered (their KV is never
    computed), so a removal follows their store at once."""
    sched = Scheduler(
        _config(max_num_batched_tokens=200, long_prefill_token_threshold=32, policy="priority")
    )
    sched.add_request(Request("low", list(range(96)), 4, priority=1, arrival_time=0.0))
    sched.update_from_output(out := sched.schedule(), _outputs_for(out))
    sched.add_request(Request("high", [7] * 16, 4, priority=0, arrival_time=1.0))
    sched.update_from_output(out := sched.schedule(), _outputs_for(out))
    sched.take_kv_events()
    out = sched.schedule()
    assert out.preempted_req_ids == {"low"}
    events = sched.take_kv_events()
    stored = [e for e in events if e[0] == "stored" and e[1] == "low"]
    assert [e[2] for e in stored] == [4], "low registered its blocks 4 and 5 ..."
    withdrawn = stored[0][4]
    assert [e[1] for e in events if e[0] == "removed"][-2:] == withdrawn, "... then withdrew them"
