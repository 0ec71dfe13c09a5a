"""Padding conventions (out= with spare capacity, CUDA-graph padding requests) and dispatch."""

from __future__ import annotations

import pytest
import torch
from dflash_expand_oracle import poison

from dflash_rs.kernels import (
    PAD_POSITION,
    PAD_SLOT_ID,
    PAD_TOKEN_ID,
    DFlashInputs,
    expand_dflash_inputs,
    triton_available,
)

BACKENDS = ("triton", "reference")


def _poisoned(max_reqs: int, max_ctx: int, k: int, device: str) -> DFlashInputs:
    return poison(DFlashInputs.empty(max_reqs, max_ctx, k, device))


def _batch(device: str, lengths: list[int], num_reqs_padded: int, num_ctx_padded: int):
    """Requests with ``lengths`` context tokens, padded CUDA-graph style: extra requests have
    empty ranges and extra context lanes lie past the last request (validate=False only)."""
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    starts += [starts[-1]] * (num_reqs_padded - len(lengths))
    positions = list(range(100, 100 + num_ctx_padded))
    return (
        torch.arange(1, num_reqs_padded + 1, dtype=torch.int32, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.arange(1, 16 * num_reqs_padded + 1, dtype=torch.int32, device=device).view(-1, 16),
    )


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_requests_and_lanes(device, backend, strict):
    k, block = 2, 16
    batch = _batch(device, [3, 2], num_reqs_padded=4, num_ctx_padded=7)
    out = _poisoned(6, 9, k, device)
    extra = {"num_blocks_per_row": torch.full((4,), 16, dtype=torch.int32, device=device)}
    result = expand_dflash_inputs(
        *batch,
        block_size=block,
        num_speculative_tokens=k,
        mask_token_id=99,
        out=out,
        validate=False,
        backend=backend,
        **(extra if strict else {}),
    )
    assert result is out
    # Requests 0 and 1 are real; 2 and 3 (empty ranges) and 4, 5 (capacity) are padding.
    real_ids = [1, 99, 99, 2, 99, 99]
    assert out.input_ids.tolist() == real_ids + [PAD_TOKEN_ID] * 12
    assert out.query_positions.tolist() == [103, 104, 105, 105, 106, 107] + [PAD_POSITION] * 12
    # Row r of the table starts at block id 16*r + 1; positions 103..107 are in column 6.
    real_slots = [7 * 16 + 7, 7 * 16 + 8, 7 * 16 + 9, 23 * 16 + 9, 23 * 16 + 10, 23 * 16 + 11]
    assert out.query_slot_mapping.tolist() == real_slots + [PAD_SLOT_ID] * 12
    assert out.token_indices_to_sample.tolist() == [
        r * (k + 1) + q for r in range(6) for q in range(1, k + 1)
    ]
    # Context lanes 5, 6 are past the last request: copied positions, no slot.
    assert out.context_positions.tolist() == list(range(100, 107)) + [PAD_POSITION] * 2
    assert out.context_slot_mapping.tolist() == (
        [7 * 16 + 4, 7 * 16 + 5, 7 * 16 + 6, 23 * 16 + 7, 23 * 16 + 8] + [PAD_SLOT_ID] * 4
    )
    assert out.num_violations.tolist() == [0]  # padding is not a violation


@pytest.mark.parametrize("backend", BACKENDS)
def test_smaller_batch_overwrites_every_lane(device, backend):
    """Reusing out= for a smaller batch leaves nothing of the larger one behind."""
    out = DFlashInputs.empty(4, 12, 3, device)
    common = dict(block_size=16, num_speculative_tokens=3, mask_token_id=99, out=out)
    expand_dflash_inputs(*_batch(device, [3, 3, 3, 3], 4, 12), **common, backend=backend)
    expand_dflash_inputs(*_batch(device, [2], 1, 2), **common, backend=backend)
    assert out.input_ids.tolist() == [1, 99, 99, 99] + [PAD_TOKEN_ID] * 12
    assert out.query_slot_mapping.tolist()[4:] == [PAD_SLOT_ID] * 12
    assert out.context_slot_mapping.tolist()[2:] == [PAD_SLOT_ID] * 10
    assert out.context_positions.tolist()[2:] == [PAD_POSITION] * 10


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(device, backend):
    empty_i32 = torch.zeros(0, dtype=torch.int32, device=device)
    result = expand_dflash_inputs(
        empty_i32,
        torch.zeros(0, dtype=torch.int64, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        torch.zeros((0, 4), dtype=torch.int32, device=device),
        block_size=16,
        num_speculative_tokens=2,
        mask_token_id=99,
        num_blocks_per_row=empty_i32,
        out=_poisoned(2, 3, 2, device),
        backend=backend,
    )
    assert result.query_slot_mapping.tolist() == [PAD_SLOT_ID] * 6
    assert result.context_slot_mapping.tolist() == [PAD_SLOT_ID] * 3
    assert result.token_indices_to_sample.tolist() == [1, 2, 4, 5]
    assert result.num_violations.tolist() == [0]


def test_dflash_inputs_empty_and_narrow(device):
    out = DFlashInputs.empty(8, 100, 3, device)
    assert (out.max_num_reqs, out.max_num_ctx) == (8, 100)
    assert out.input_ids.numel() == 32 and out.token_indices_to_sample.numel() == 24
    assert out.num_violations.tolist() == [0] and not out.violation_partials.any()
    view = out.narrow(2, 10)
    assert view.input_ids.numel() == 8 and view.context_slot_mapping.numel() == 10
    assert view.token_indices_to_sample.numel() == 6
    assert view.input_ids.data_ptr() == out.input_ids.data_ptr()


def test_backend_selection(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available(torch.device("cpu"))
    assert not triton_available(torch.device("meta"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not triton_available(torch.device("cpu"))


def test_auto_backend_falls_back_to_the_reference(monkeypatch):
    """Without a GPU or the interpreter, 'auto' runs the pure-torch path."""
    import dflash_rs.kernels.dflash_expand as kernel_module

    def refuse(args):
        raise AssertionError("the Triton launcher must not run")

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(kernel_module, "launch_expand_kernel", refuse)
    batch = _batch("cpu", [2], 1, 2)
    result = expand_dflash_inputs(*batch, block_size=16, num_speculative_tokens=1, mask_token_id=9)
    assert result.query_positions.tolist() == [102, 103]
