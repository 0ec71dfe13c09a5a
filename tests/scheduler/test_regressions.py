"""Regression tests for scheduler bugs found in review (each fails on the old behaviour)."""

from __future__ import annotations

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig


def _outputs_for(out):
    return ModelRunnerOutput(out.req_ids, [[] if c else [1] for c in out.is_prefill_chunk])


def test_undone_priority_victim_leaves_no_uncomputed_prefix_in_the_cache() -> None:
    # "low" is prefilled in 32-token chunks. In its third step it is scheduled (registering
    # the blocks of positions 64..95 in the prefix cache) and then preempted in the same step
    # by "high". Its KV for 64..95 is never computed, so those blocks must not be hits later.
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=8,
            block_size=16,
            max_model_len=112,
            max_num_batched_tokens=200,
            long_prefill_token_threshold=32,
            policy="priority",
        )
    )
    sched.add_request(Request("low", list(range(96)), 4, priority=1, arrival_time=0.0))
    out = sched.schedule()
    sched.update_from_output(out, _outputs_for(out))
    sched.add_request(Request("high", [7] * 16, 4, priority=0, arrival_time=1.0))
    out = sched.schedule()
    sched.update_from_output(out, _outputs_for(out))
    out = sched.schedule()
    assert out.preempted_req_ids == {"low"}
    sched.check_invariants()
    sched.update_from_output(out, _outputs_for(out))
    sched.finish_requests(["high"])
    out = sched.schedule()
    (resumed,) = out.scheduled_new_reqs
    assert resumed.req_id == "low" and resumed.resumed
    assert resumed.num_computed_tokens == 64, "only positions 0..63 were ever computed"


def test_prompt_of_exactly_max_model_len_finishes_under_chunked_prefill() -> None:
    sched = Scheduler(
        SchedulerConfig(num_blocks=64, block_size=16, max_model_len=64, max_num_batched_tokens=24)
    )
    sched.add_request(Request("full", list(range(64)), 8))
    finish = None
    for _ in range(10):
        out = sched.schedule()
        sched.check_invariants()
        for r in sched.update_from_output(out, _outputs_for(out)):
            finish = r.finish_reason
        if not sched.has_unfinished_requests():
            break
    assert finish == "length"
    assert not sched.has_unfinished_requests()
    assert sched.num_free_blocks == 63


def test_request_that_outgrows_the_whole_pool_ends_instead_of_preempting_itself_forever() -> None:
    # 4 usable blocks = 64 slots; the request needs more as it decodes. Alone in the pool and
    # still short, it is ended with an error rather than preempting itself on every step, and
    # update_from_output says so. Such a pool is refused unless pool_must_hold_max_model_len
    # is off (vLLM's Scheduler class semantics, which the vLLM drop-in follows).
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=5, block_size=16, max_model_len=128, pool_must_hold_max_model_len=False
        )
    )
    sched.add_request(Request("r", [7] * 60, max_tokens=20))
    finished: set = set()
    reasons = []
    for _ in range(40):
        out = sched.schedule()
        finished |= out.finished_req_ids
        sched.check_invariants()
        results = sched.update_from_output(out, _outputs_for(out))
        reasons += [(r.request_id, r.finish_reason) for r in results if r.finished]
        if not sched.has_unfinished_requests():
            break
    finished |= sched.schedule().finished_req_ids
    assert not sched.has_unfinished_requests()
    assert finished == {"r"}
    assert reasons == [("r", "error")]
    assert sched.stats()["num_preemptions"] == 0
    assert sched.num_free_blocks == 4


def test_request_that_would_outgrow_the_pool_is_refused_with_its_config() -> None:
    # By default the pool above is refused, as vLLM's engine refuses it at startup; with the
    # max_model_len it holds, the same request stops at the length limit: no preemption, no
    # error.
    import pytest

    from dflash_rs import InvalidArgumentError

    with pytest.raises(
        InvalidArgumentError, match=r"that needs cdiv\(128, block_size 16\) = 8 blocks"
    ):
        SchedulerConfig(num_blocks=5, block_size=16, max_model_len=128)
    sched = Scheduler(SchedulerConfig(num_blocks=5, block_size=16, max_model_len=64))
    sched.add_request(Request("r", [7] * 60, max_tokens=20))
    reasons = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.check_invariants()
        reasons += [r.finish_reason for r in sched.update_from_output(out, _outputs_for(out))]
    assert reasons[-1] == "length" and reasons.count(None) == len(reasons) - 1
    assert sched.stats()["num_preemptions"] == 0
    assert sched.num_free_blocks == 4


def test_prompt_larger_than_the_pool_is_refused_at_admission() -> None:
    import pytest

    from dflash_rs import OutOfBlocksError

    sched = Scheduler(
        SchedulerConfig(
            num_blocks=5, block_size=16, max_model_len=128, pool_must_hold_max_model_len=False
        )
    )
    with pytest.raises(OutOfBlocksError, match="needs 5 KV blocks but the pool has only 4"):
        sched.add_request(Request("big", [7] * 65, max_tokens=1))
    assert sched.get_num_unfinished_requests() == 0
    sched.check_invariants()


def test_prompt_larger_than_the_pool_is_refused_as_too_long() -> None:
    # A prompt larger than the pool is larger than max_model_len once the pool holds one
    # max_model_len request: it is refused as too long, before the pool is consulted.
    import pytest

    from dflash_rs import PromptTooLongError

    sched = Scheduler(SchedulerConfig(num_blocks=5, block_size=16, max_model_len=64))
    with pytest.raises(PromptTooLongError, match="prompt of 65 tokens exceeds max_model_len 64"):
        sched.add_request(Request("big", [7] * 65, max_tokens=1))
    assert sched.get_num_unfinished_requests() == 0
    sched.check_invariants()


def test_request_outputs_stay_out_of_the_garbage_collector() -> None:
    # One RequestOutput per request per step: tracked objects would trigger young-generation
    # collections every step at 1,000 requests. They hold only a str and Rust data (no cycles).
    import gc

    sched = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=1008))
    sched.add_request(Request("a", [1, 2, 3], 4))
    out = sched.schedule()
    (result,) = sched.update_from_output(out, _outputs_for(out))
    assert result.request_id == "a" and result.new_token_ids == [1]
    assert not gc.is_tracked(result)


def test_prompt_whose_lookahead_overflows_the_pool_is_refused_at_admission() -> None:
    # Found by the scheduler fuzz target ("stuck-pool"): 11 usable 1-token blocks, EAGLE K=1, an
    # 11-token prompt. The prompt alone fits, but its last prefill step also writes the one
    # lookahead slot, so it could never be admitted and blocked the queue forever.
    import pytest

    from dflash_rs import OutOfBlocksError, SpeculativeConfig

    sched = Scheduler(
        SchedulerConfig(
            num_blocks=12,
            block_size=1,
            max_model_len=64,
            speculative=SpeculativeConfig("eagle", 1),
            pool_must_hold_max_model_len=False,
        )
    )
    with pytest.raises(OutOfBlocksError, match="plus 1 lookahead slots needs 12 KV blocks"):
        sched.add_request(Request("big", list(range(1, 12)), max_tokens=2))
    sched.add_request(Request("fits", list(range(1, 11)), max_tokens=1))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert list(out.req_ids) == ["fits"], "the request that fits is served"
        sched.update_from_output(out, _outputs_for(out))
    sched.check_invariants()


def test_prompt_of_max_model_len_with_lookahead_fits_the_smallest_legal_pool() -> None:
    # Found by the scheduler fuzz target ("stuck-pool"): 11 usable 1-token blocks, EAGLE K=1, an
    # 11-token prompt whose last prefill step also writes one lookahead slot used to block the
    # queue forever (max_model_len 64). Such a pool is refused now; in the smallest legal one,
    # max_model_len 11, the lookahead stops at max_model_len and the prompt is served.
    import pytest

    from dflash_rs import InvalidArgumentError, SpeculativeConfig

    eagle = SpeculativeConfig("eagle", 1)
    with pytest.raises(InvalidArgumentError, match="65 in all"):
        SchedulerConfig(num_blocks=12, block_size=1, max_model_len=64, speculative=eagle)
    sched = Scheduler(
        SchedulerConfig(num_blocks=12, block_size=1, max_model_len=11, speculative=eagle)
    )
    sched.add_request(Request("big", list(range(1, 12)), max_tokens=2))
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert list(out.req_ids) == ["big"], "the request that fills max_model_len is served"
        sched.check_invariants()
        sched.update_from_output(out, _outputs_for(out))
    assert sched.stats()["num_preemptions"] == 0 and sched.num_free_blocks == 11
