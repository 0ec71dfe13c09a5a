"""vLLM 0.33's uniform-decode padding (``pad_admitted_decodes=True``): an admitted request with
one token left to compute joins a decode batch as 1 + K tokens with K placeholder drafts
(``-1``), and its lookahead still covers every written slot."""

from __future__ import annotations

from typing import Any

import pytest

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig

BS, K = 16, 3


def _step(s: Scheduler, bonus: int = 5) -> Any:
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(
        out, ModelRunnerOutput(out.req_ids, [[] if c else [bonus] for c in out.is_prefill_chunk])
    )
    return out


def _scheduler(pad: bool) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=BS,
            max_model_len=256,
            speculative=SpeculativeConfig("dflash", K),
            pad_admitted_decodes=pad,
        )
    )


@pytest.mark.parametrize("pad", [True, False])
def test_full_prefix_hit_joins_the_decode_batch_padded(pad: bool) -> None:
    s = _scheduler(pad)
    prompt = list(range(1, 2 * BS + 2))  # 33 tokens: two full blocks, then one token
    s.add_request(Request("a", prompt, 50))
    _step(s)  # a's prefill; its two full blocks enter the prefix cache
    s.add_request(Request("b", prompt, 50))
    out = s.schedule()
    i = out.req_ids.index("b")
    assert int(out.num_computed_tokens[i]) == 2 * BS  # the full hit
    if pad:
        assert out.num_scheduled_tokens["b"] == 1 + K
        assert out.scheduled_spec_decode_tokens["b"] == [-1] * K
    else:
        assert out.num_scheduled_tokens["b"] == 1
        assert "b" not in out.scheduled_spec_decode_tokens
    # Written slots (scheduled tokens and DFlash's K + 1 lookahead) lie in b's own blocks.
    last_slot = 2 * BS + out.num_scheduled_tokens["b"] + (K + 1)
    assert len(s.block_ids("b")) * BS >= last_slot
    s.check_invariants()
    # The model rejects every placeholder: b keeps 33 computed tokens and one new token.
    s.update_from_output(
        out, ModelRunnerOutput(out.req_ids, [[] if c else [9] for c in out.is_prefill_chunk])
    )
    assert s.num_computed_tokens("b") == 2 * BS + 1
    assert s.all_token_ids("b") == [*prompt, 9]


def test_padding_only_joins_pure_decode_batches() -> None:
    """Padded while every running request decodes; not while one is mid-prefill."""
    s = _scheduler(True)
    s.add_request(Request("long", list(range(500, 700)), 5))  # prefilled in one step
    s.add_request(Request("warm", list(range(1, 2 * BS + 2)), 50))
    _step(s)
    s.add_request(Request("b", list(range(1, 2 * BS + 2)), 50))
    assert s.schedule().scheduled_spec_decode_tokens.get("b") == [-1] * K

    s2 = Scheduler(
        SchedulerConfig(
            num_blocks=64,
            block_size=BS,
            max_model_len=256,
            max_num_batched_tokens=64,
            long_prefill_token_threshold=32,
            speculative=SpeculativeConfig("dflash", K),
            pad_admitted_decodes=True,
        )
    )
    s2.add_request(Request("warm", list(range(1, 2 * BS + 2)), 50))
    _step(s2)
    s2.add_request(Request("chunked", list(range(500, 700)), 5))
    _step(s2)  # chunked is now mid-prefill
    s2.add_request(Request("b", list(range(1, 2 * BS + 2)), 50))
    out = s2.schedule()
    assert "chunked" in out.req_ids
    assert "b" in out.req_ids
    assert out.num_scheduled_tokens["b"] == 1
    assert "b" not in out.scheduled_spec_decode_tokens


def test_a_budget_below_one_plus_k_does_not_block_a_lone_admission() -> None:
    # Found by the stateful test: with nothing running, a full prefix hit padded to 1 + K
    # tokens never fit a 3-token budget, so the request waited forever.
    s = Scheduler(
        SchedulerConfig(
            num_blocks=40,
            block_size=1,
            max_model_len=32,
            max_num_seqs=1,
            max_num_batched_tokens=3,
            speculative=SpeculativeConfig("ngram", K),
            pad_admitted_decodes=True,
        )
    )
    s.add_request(Request("a", [1, 2, 3, 4, 5], 1))
    while s.has_unfinished_requests():
        _step(s)
    s.add_request(Request("b", [1, 2, 3, 4, 5], 1))
    out = _step(s)
    assert list(out.req_ids) == ["b"] and out.num_scheduled_tokens["b"] == 1
    assert not s.has_unfinished_requests()
