"""Bad inputs raise InvalidArgumentError with a message naming the problem."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs, expand_dflash_inputs_reference


def _good(device: str) -> dict[str, Any]:
    """A valid call: 2 requests with 3 and 2 context tokens, K=2, block 16."""
    return {
        "next_token_ids": torch.tensor([7, 8], dtype=torch.int32, device=device),
        "target_positions": torch.tensor([0, 1, 2, 5, 6], dtype=torch.int64, device=device),
        "query_start_loc": torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
        "block_table": torch.tensor([[1, 2], [3, 4]], dtype=torch.int32, device=device),
        "block_size": 16,
        "num_speculative_tokens": 2,
        "mask_token_id": 99,
    }


def _call(kwargs: dict[str, Any], fn: Callable = expand_dflash_inputs) -> DFlashInputs:
    kwargs = dict(kwargs)
    positional = [kwargs.pop(name) for name in _POSITIONAL]
    return fn(*positional, **kwargs)


_POSITIONAL = ("next_token_ids", "target_positions", "query_start_loc", "block_table")


def _i32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t``, as a non-contiguous view (every other element)."""
    return torch.stack([t, t], dim=-1)[..., 0]


# (name, change to the good call, expected message fragment)
STRUCTURAL = [
    (
        "ids dtype",
        lambda a: a.update(next_token_ids=a["next_token_ids"].long()),
        "next_token_ids must have dtype torch.int32",
    ),
    (
        "positions dtype",
        lambda a: a.update(target_positions=a["target_positions"].int()),
        "target_positions must have dtype torch.int64",
    ),
    (
        "positions 2-D",
        lambda a: a.update(target_positions=a["target_positions"][None]),
        "target_positions must be 1-D",
    ),
    (
        "positions list",
        lambda a: a.update(target_positions=[0, 1, 2, 5, 6]),
        "target_positions must be a torch.Tensor",
    ),
    (
        "qsl dtype",
        lambda a: a.update(query_start_loc=a["query_start_loc"].long()),
        "query_start_loc must have dtype torch.int32",
    ),
    (
        "qsl length",
        lambda a: a.update(query_start_loc=a["query_start_loc"][:2]),
        "query_start_loc must have num_reqs + 1",
    ),
    (
        "qsl strided",
        lambda a: a.update(query_start_loc=torch.stack([a["query_start_loc"]] * 2, 1)[:, 0]),
        "query_start_loc must be contiguous",
    ),
    (
        "table dtype",
        lambda a: a.update(block_table=a["block_table"].long()),
        "block_table must have dtype torch.int32",
    ),
    ("table 1-D", lambda a: a.update(block_table=a["block_table"][0]), "block_table must be 2-D"),
    ("table rows", lambda a: a.update(block_table=a["block_table"][:1]), "fewer than num_reqs=2"),
    (
        "table columns",
        lambda a: a.update(block_table=a["block_table"][:, :0]),
        "at least one column",
    ),
    (
        "table column stride",
        lambda a: a.update(block_table=a["block_table"].t().contiguous().t()),
        "stride(1) == 1",
    ),
    (
        "K zero",
        lambda a: a.update(num_speculative_tokens=0),
        "num_speculative_tokens must be in [1",
    ),
    (
        "K bool",
        lambda a: a.update(num_speculative_tokens=True),
        "num_speculative_tokens must be an integer",
    ),
    (
        "K float",
        lambda a: a.update(num_speculative_tokens=2.0),
        "num_speculative_tokens must be an integer",
    ),
    ("block size zero", lambda a: a.update(block_size=0), "block_size must be in [1"),
    ("mask id range", lambda a: a.update(mask_token_id=2**31), "mask_token_id must be in"),
    (
        "max_model_len alone",
        lambda a: a.update(max_model_len=10),
        "max_model_len is only checked in strict mode",
    ),
    (
        "max_model_len zero",
        lambda a: a.update(
            max_model_len=0, num_blocks_per_row=_i32([1, 1], a["block_table"].device)
        ),
        "max_model_len must be in [1",
    ),
    (
        "rejected dtype",
        lambda a: a.update(num_rejected_tokens=torch.zeros(2, dtype=torch.int64)),
        "num_rejected_tokens must have dtype torch.int32",
    ),
    (
        "rejected length",
        lambda a: a.update(num_rejected_tokens=_i32([0], a["block_table"].device)),
        "num_rejected_tokens must have num_reqs=2 entries",
    ),
    (
        "per-row length",
        lambda a: a.update(num_blocks_per_row=_i32([1], a["block_table"].device)),
        "num_blocks_per_row has 1 entries, fewer than num_reqs=2",
    ),
    (
        "per-row dtype",
        lambda a: a.update(num_blocks_per_row=torch.ones(2, dtype=torch.int64)),
        "num_blocks_per_row must have dtype torch.int32",
    ),
    (
        "device",
        lambda a: a.update(next_token_ids=torch.empty(2, dtype=torch.int32, device="meta")),
        "next_token_ids is on meta",
    ),
    (
        "accumulate without strict",
        lambda a: a.update(accumulate_violations=True),
        "accumulate_violations needs strict mode",
    ),
    (
        "accumulate without out",
        lambda a: a.update(
            accumulate_violations=True,
            num_blocks_per_row=_i32([1, 1], a["block_table"].device),
        ),
        "accumulate_violations needs out=",
    ),
    ("out type", lambda a: a.update(out=object()), "out must be a DFlashInputs"),
    (
        "ids 2-D",
        lambda a: a.update(next_token_ids=a["next_token_ids"][None]),
        "next_token_ids must be 1-D, got shape (1, 2)",
    ),
    (
        "ids list",
        lambda a: a.update(next_token_ids=[7, 8]),
        "next_token_ids must be a torch.Tensor, got list",
    ),
    (
        "table numpy",
        lambda a: a.update(block_table=a["block_table"].cpu().numpy()),
        "block_table must be a torch.Tensor, got ndarray",
    ),
    (
        "ids strided",
        lambda a: a.update(next_token_ids=_strided(a["next_token_ids"])),
        "next_token_ids must be contiguous",
    ),
    (
        "positions strided",
        lambda a: a.update(target_positions=_strided(a["target_positions"])),
        "target_positions must be contiguous",
    ),
    (
        "rejected strided",
        lambda a: a.update(
            num_rejected_tokens=_strided(_i32([0, 0], a["block_table"].device)),
        ),
        "num_rejected_tokens must be contiguous",
    ),
    (
        "per-row strided",
        lambda a: a.update(num_blocks_per_row=_strided(_i32([1, 1], a["block_table"].device))),
        "num_blocks_per_row must be contiguous",
    ),
    (
        "rejected 2-D",
        lambda a: a.update(num_rejected_tokens=_i32([[0, 0]], a["block_table"].device)),
        "num_rejected_tokens must be 1-D",
    ),
    (
        "table overlapping rows",
        lambda a: a.update(block_table=a["block_table"].flatten().as_strided((2, 2), (1, 1))),
        "block_table row stride 1 is smaller than its width 2",
    ),
    (
        "qsl device",
        lambda a: a.update(query_start_loc=torch.empty(3, dtype=torch.int32, device="meta")),
        "query_start_loc is on meta",
    ),
    (
        "table device",
        lambda a: a.update(block_table=torch.empty((2, 2), dtype=torch.int32, device="meta")),
        "block_table is on meta",
    ),
    (
        "rejected device",
        lambda a: a.update(num_rejected_tokens=torch.empty(2, dtype=torch.int32, device="meta")),
        "num_rejected_tokens is on meta",
    ),
    (
        "per-row device",
        lambda a: a.update(num_blocks_per_row=torch.empty(2, dtype=torch.int32, device="meta")),
        "num_blocks_per_row is on meta",
    ),
    (
        "out device",
        lambda a: a.update(out=DFlashInputs.empty(2, 5, 2, "meta")),
        "out.input_ids is on meta",
    ),
    (
        "K huge",
        lambda a: a.update(num_speculative_tokens=2**31),
        "num_speculative_tokens must be in [1, 2147483647], got 2147483648",
    ),
    ("K negative", lambda a: a.update(num_speculative_tokens=-1), "num_speculative_tokens"),
    ("block size huge", lambda a: a.update(block_size=2**31), "block_size must be in [1"),
    ("block size bool", lambda a: a.update(block_size=True), "block_size must be an integer"),
    ("mask id float", lambda a: a.update(mask_token_id=99.0), "mask_token_id must be an integer"),
    (
        "max_model_len float",
        lambda a: a.update(
            max_model_len=8.0, num_blocks_per_row=_i32([1, 1], a["block_table"].device)
        ),
        "max_model_len must be an integer",
    ),
    (
        "out K",
        lambda a: a.update(out=DFlashInputs.empty(2, 5, 3, a["block_table"].device)),
        "allocated for num_speculative_tokens=3",
    ),
    (
        "out requests",
        lambda a: a.update(out=DFlashInputs.empty(1, 5, 2, a["block_table"].device)),
        "fewer than num_reqs=2",
    ),
    (
        "out context",
        lambda a: a.update(out=DFlashInputs.empty(2, 4, 2, a["block_table"].device)),
        "fewer than 5",
    ),
]

VALUES = [
    (
        "qsl start",
        lambda a: a.update(query_start_loc=_i32([1, 3, 5], a["block_table"].device)),
        "query_start_loc[0] must be 0",
    ),
    (
        "qsl order",
        lambda a: a.update(query_start_loc=_i32([0, 6, 5], a["block_table"].device)),
        "non-decreasing",
    ),
    (
        "qsl end",
        lambda a: a.update(query_start_loc=_i32([0, 3, 4], a["block_table"].device)),
        "query_start_loc[-1] must equal num_ctx=5",
    ),
    (
        "empty request",
        lambda a: a.update(query_start_loc=_i32([0, 0, 5], a["block_table"].device)),
        "request 0 has zero context tokens",
    ),
    (
        "rejected too many",
        lambda a: a.update(num_rejected_tokens=_i32([0, 2], a["block_table"].device)),
        "num_rejected_tokens[1]=2 leaves request 1 no valid context token",
    ),
    (
        "rejected negative",
        lambda a: a.update(num_rejected_tokens=_i32([-1, 0], a["block_table"].device)),
        "num_rejected_tokens[0] is negative",
    ),
    (
        "negative position",
        lambda a: a["target_positions"].__setitem__(3, -4),
        "target_positions[3] is negative",
    ),
    (
        "per-row too large",
        lambda a: a.update(num_blocks_per_row=_i32([1, 3], a["block_table"].device)),
        "num_blocks_per_row[1]=3 is outside",
    ),
]


@pytest.mark.parametrize(
    ("what", "change", "message"),
    STRUCTURAL + VALUES,
    ids=lambda v: v if isinstance(v, str) else "",
)
@pytest.mark.parametrize("fn", [expand_dflash_inputs, expand_dflash_inputs_reference])
def test_bad_input_raises(device, fn, what, change, message):
    kwargs = _good(device)
    change(kwargs)
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call(kwargs, fn)


@pytest.mark.parametrize(
    ("what", "change", "message"), VALUES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_value_checks_are_skipped_without_validate(device, what, change, message):
    """validate=False reads no data (CUDA-graph path); the kernel stays memory-safe."""
    kwargs = _good(device)
    change(kwargs)
    for backend in ("triton", "reference"):
        _call({**kwargs, "validate": False, "backend": backend})


def test_invalid_argument_error_is_a_value_error(device):
    kwargs = _good(device)
    kwargs["block_size"] = -1
    with pytest.raises(ValueError, match="block_size"):
        _call(kwargs)


def test_unknown_backend(device):
    with pytest.raises(InvalidArgumentError, match="backend must be"):
        _call({**_good(device), "backend": "cuda"})


def test_triton_backend_without_gpu_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidArgumentError, match="backend='triton' needs CUDA tensors"):
        _call({**_good("cpu"), "backend": "triton"})


def _escape(message: str) -> str:
    import re

    return re.escape(message)
