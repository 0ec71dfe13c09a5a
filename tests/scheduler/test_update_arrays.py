"""``update_from_output_arrays`` is ``update_from_output`` with flat arrays as the result: two
schedulers driven by the same random steps, one through each API, return the same tokens and
finishes and end in the same state."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_rs import (
    InvalidArgumentError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
)


def _pair() -> tuple[Scheduler, Scheduler]:
    config = SchedulerConfig(
        num_blocks=120,
        block_size=16,
        max_model_len=512,
        max_num_seqs=12,
        max_num_batched_tokens=256,
        speculative=SpeculativeConfig("dflash", 4),
    )
    return Scheduler(config), Scheduler(config)


@pytest.mark.parametrize("seed", range(4))
def test_arrays_result_matches_the_list_result(seed: int) -> None:
    rng = np.random.default_rng(seed)
    lists, arrays = _pair()
    for i in range(30):
        prompt = rng.integers(3, 50, int(rng.integers(1, 120))).tolist()
        max_tokens = int(rng.integers(1, 40))
        for s in (lists, arrays):
            s.add_request(Request(f"r{i}", prompt, max_tokens, eos_token_id=7, min_tokens=1))
    steps = 0
    while lists.has_unfinished_requests():
        a, b = lists.schedule(), arrays.schedule()
        assert a.req_ids == b.req_ids
        spec = a.num_spec_tokens_array.astype(np.int64)
        counts = np.where(a.is_prefill_chunk, 0, rng.integers(0, spec + 1) + 1).astype(np.int32)
        tokens = rng.integers(3, 12, int(counts.sum())).astype(np.int32)
        expected = lists.update_from_output(
            a, ModelRunnerOutput.from_arrays(a.req_ids, tokens, counts)
        )
        got = arrays.update_from_output_arrays(
            b, ModelRunnerOutput.from_arrays(b.req_ids, tokens, counts)
        )
        assert len(got) == len(expected)
        assert [b.req_ids[j] for j in got.batch_index] == [r.request_id for r in expected]
        assert got.num_new_tokens.tolist() == [len(r.new_token_ids) for r in expected]
        assert got.new_token_ids.tolist() == [t for r in expected for t in r.new_token_ids]
        done = [r for r in expected if r.finished]
        assert got.finished_req_ids == [r.request_id for r in done]
        assert got.finish_reasons == [r.finish_reason for r in done]
        assert got.stop_reasons == [r.stop_reason for r in done]
        steps += 1
    assert steps > 10 and not arrays.has_unfinished_requests()
    arrays.check_invariants()
    assert arrays.stats() == lists.stats()


def test_arrays_result_of_an_empty_step_and_bad_input() -> None:
    s, _ = _pair()
    out = s.schedule()  # nothing to schedule
    res = s.update_from_output_arrays(out, ModelRunnerOutput([], []))
    assert len(res) == 0 and res.new_token_ids.size == 0 and res.finished_req_ids == []
    s.add_request(Request("a", [1, 2, 3], 2))
    out = s.schedule()
    with pytest.raises(InvalidArgumentError, match="req_ids"):
        s.update_from_output_arrays(out, ModelRunnerOutput(["zzz"], [[1]]))
    res = s.update_from_output_arrays(out, ModelRunnerOutput(out.req_ids, [[5]]))
    assert res.batch_index.tolist() == [0] and res.new_token_ids.tolist() == [5]
    assert "UpdateResult(entries=1" in repr(res)
