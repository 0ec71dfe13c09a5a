"""Strict mode on hand-built tables: exact PAD lanes and exact violation counts.

Each case also shows what default (vLLM) mode does with the same table, i.e. the hazard strict
mode exists to catch (section 4.5 of the semantics reference).
"""

from __future__ import annotations

import pytest
import torch

from dflash_rs.kernels import PAD_SLOT_ID, DFlashInputs, expand_dflash_inputs

BACKENDS = ("triton", "reference")
BLOCK = 16


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _i64(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _prompt_batch(device: str, prompt_len: int, row: list[int]):
    """One request whose whole prompt (positions 0..prompt_len-1) is this step's context."""
    return (
        _i32([42], device),
        _i64(list(range(prompt_len)), device),
        _i32([0, prompt_len], device),
        _i32([row], device),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_prefill_without_lookahead_block(device, backend):
    """16-token prompt, K=3, the row owns one block: the 4 queries (16..19) have no slot."""
    batch = _prompt_batch(device, 16, [5, 0, 0, 0, 0, 0, 0, 0])
    common = dict(block_size=BLOCK, num_speculative_tokens=3, mask_token_id=99, backend=backend)
    strict = expand_dflash_inputs(*batch, **common, num_blocks_per_row=_i32([1], device))
    assert strict.query_positions.tolist() == [16, 17, 18, 19]
    assert strict.query_slot_mapping.tolist() == [PAD_SLOT_ID] * 4
    assert strict.context_slot_mapping.tolist() == list(range(80, 96))
    assert strict.num_violations.tolist() == [4]
    assert strict.input_ids.tolist() == [42, 99, 99, 99]
    # vLLM's kernel reads column 1 anyway: id 0, so the queries write into the null block.
    default = expand_dflash_inputs(*batch, **common)
    assert default.query_slot_mapping.tolist() == [0, 1, 2, 3]
    assert default.num_violations.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_prefill_with_lookahead_block(device, backend):
    """With K+1 lookahead the row owns two blocks and every query lane has a slot."""
    batch = _prompt_batch(device, 16, [5, 9, 0, 0])
    result = expand_dflash_inputs(
        *batch,
        block_size=BLOCK,
        num_speculative_tokens=3,
        mask_token_id=99,
        num_blocks_per_row=_i32([2], device),
        backend=backend,
    )
    assert result.query_slot_mapping.tolist() == [144, 145, 146, 147]
    assert result.num_violations.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_block_id_past_the_row_count(device, backend):
    """A stale id beyond the row's count is never used in strict mode (default mode uses it)."""
    batch = _prompt_batch(device, 30, [5, 6, 77, 0])  # 77: left over by the row's previous user
    common = dict(block_size=BLOCK, num_speculative_tokens=3, mask_token_id=99, backend=backend)
    strict = expand_dflash_inputs(*batch, **common, num_blocks_per_row=_i32([2], device))
    # Positions 30, 31 are in block 1 (owned); 32, 33 are in block 2 (not owned).
    assert strict.query_slot_mapping.tolist() == [6 * 16 + 14, 6 * 16 + 15, -1, -1]
    assert strict.num_violations.tolist() == [2]
    default = expand_dflash_inputs(*batch, **common)
    assert default.query_slot_mapping.tolist() == [110, 111, 77 * 16, 77 * 16 + 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_null_block_in_an_owned_column(device, backend):
    """Block id 0 inside the owned columns maps context and query lanes to PAD."""
    # Request 0: positions 14..17 (block 0 -> id 3, block 1 -> id 0); request 1: position 40.
    next_tokens = _i32([1, 2], device)
    positions = _i64([14, 15, 16, 17, 40], device)
    qsl = _i32([0, 4, 5], device)
    table = _i32([[3, 0, 8, 0], [0, 0, 4, 0]], device)
    result = expand_dflash_inputs(
        next_tokens,
        positions,
        qsl,
        table,
        block_size=BLOCK,
        num_speculative_tokens=2,
        mask_token_id=99,
        num_blocks_per_row=_i32([3, 3], device),
        backend=backend,
    )
    assert result.context_slot_mapping.tolist() == [62, 63, -1, -1, 4 * 16 + 8]
    # Request 0 queries: 18, 19, 20 (block 1, id 0); request 1 queries: 41, 42, 43 (block 2, id 4).
    assert result.query_slot_mapping.tolist() == [-1, -1, -1, 73, 74, 75]
    assert result.num_violations.tolist() == [5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_at_or_past_max_model_len(device, backend):
    batch = _prompt_batch(device, 20, [1, 2, 3, 4])
    result = expand_dflash_inputs(
        *batch,
        block_size=BLOCK,
        num_speculative_tokens=4,
        mask_token_id=99,
        num_blocks_per_row=_i32([4], device),
        max_model_len=22,
        backend=backend,
    )
    # Queries at 20..24: 20 and 21 fit, 22..24 do not; positions are still written.
    assert result.query_positions.tolist() == [20, 21, 22, 23, 24]
    assert result.query_slot_mapping.tolist() == [36, 37, -1, -1, -1]
    assert result.num_violations.tolist() == [3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_positions_past_the_table_width(device, backend):
    """Default mode clamps to the last column (section 4.3); strict mode refuses."""
    batch = _prompt_batch(device, 32, [1, 2])  # width 2 covers positions 0..31
    common = dict(block_size=BLOCK, num_speculative_tokens=2, mask_token_id=99, backend=backend)
    default = expand_dflash_inputs(*batch, **common)
    assert default.query_slot_mapping.tolist() == [32, 33, 34]  # block id 2, offsets 0..2
    strict = expand_dflash_inputs(*batch, **common, num_blocks_per_row=_i32([2], device))
    assert strict.query_slot_mapping.tolist() == [-1, -1, -1]
    assert strict.num_violations.tolist() == [3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_rejected_tokens_like_the_v2_runner_case(device, backend):
    """Positions 10..13 with 2 rejected, table [0, 0, 7, 8], block 4 (vLLM 0.33's V2 test).

    Queries sit at 12..14 with slots 32..34 and ids [99, 123, 123]. Rejected context lanes keep
    their real slots, as in vLLM's V1 kernel (the V2 runner pads them instead).
    """
    result = expand_dflash_inputs(
        _i32([99], device),
        _i64([10, 11, 12, 13], device),
        _i32([0, 4], device),
        _i32([[0, 0, 7, 8, 0, 0]], device),
        block_size=4,
        num_speculative_tokens=2,
        mask_token_id=123,
        num_rejected_tokens=_i32([2], device),
        num_blocks_per_row=_i32([4], device),
        backend=backend,
    )
    assert result.input_ids.tolist() == [99, 123, 123]
    assert result.query_positions.tolist() == [12, 13, 14]
    assert result.query_slot_mapping.tolist() == [32, 33, 34]
    assert result.context_slot_mapping.tolist() == [30, 31, 32, 33]
    assert result.token_indices_to_sample.tolist() == [1, 2]
    assert result.num_violations.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_violation_count_is_exact_across_reused_buffers(device, backend):
    """The counter restarts at every launch into the same out= (CUDA-graph replays need this)."""
    out = DFlashInputs.empty(4, 64, 3, device)
    batch = _prompt_batch(device, 16, [5, 9, 0, 0])
    common = dict(block_size=BLOCK, num_speculative_tokens=3, mask_token_id=99, backend=backend)
    for owned, expected in [(1, 4), (1, 4), (2, 0), (0, 20), (1, 4)]:
        result = expand_dflash_inputs(
            *batch, **common, num_blocks_per_row=_i32([owned], device), out=out
        )
        assert result.num_violations.tolist() == [expected]
    # A default-mode launch into the same buffers reports zero.
    expand_dflash_inputs(*batch, **common, out=out)
    assert out.num_violations.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulated_violation_count(device, backend):
    """accumulate_violations adds each launch's count to the caller-zeroed counter."""
    out = DFlashInputs.empty(4, 64, 3, device)
    batch = _prompt_batch(device, 16, [5, 9, 0, 0])
    common = dict(block_size=BLOCK, num_speculative_tokens=3, mask_token_id=99, backend=backend)
    total = 0
    for owned, found in [(1, 4), (2, 0), (0, 20), (1, 4)]:
        result = expand_dflash_inputs(
            *batch,
            **common,
            num_blocks_per_row=_i32([owned], device),
            out=out,
            accumulate_violations=True,
        )
        total += found
        assert result.num_violations.tolist() == [total]
        assert result.query_slot_mapping.tolist()[0] == (-1 if owned < 2 else 144)
    out.reset_violations()
    expand_dflash_inputs(
        *batch,
        **common,
        num_blocks_per_row=_i32([1], device),
        out=out,
        accumulate_violations=True,
    )
    assert out.num_violations.tolist() == [4]
