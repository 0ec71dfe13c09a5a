"""Argument checks shared by the Triton and the reference expansion.

Structural checks (types, dtypes, shapes, strides, devices) read only tensor metadata and always
run. Value checks (monotonic ``query_start_loc``, rejected counts, ...) read the data, so they cost
one device-to-host copy; ``validate=False`` skips them (the CUDA-graph path).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, NoReturn, Optional

import torch

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels._grid import num_programs
from dflash_rs.kernels.result import BUFFER_DTYPES, DFlashInputs

__all__ = ["ExpandArgs", "check_values", "prepare_expand_args"]

_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class ExpandArgs:
    """Checked arguments of one expansion, with the output buffers to fill."""

    next_token_ids: torch.Tensor
    target_positions: torch.Tensor
    query_start_loc: torch.Tensor
    block_table: torch.Tensor
    num_rejected_tokens: Optional[torch.Tensor]
    num_blocks_per_row: Optional[torch.Tensor]
    num_reqs: int
    num_ctx: int
    num_speculative_tokens: int
    block_size: int
    mask_token_id: int
    max_model_len: Optional[int]
    out: DFlashInputs
    accumulate_violations: bool = False

    @property
    def strict(self) -> bool:
        """Strict mode: lanes outside the row's owned blocks get PAD_SLOT_ID and are counted."""
        return self.num_blocks_per_row is not None

    @property
    def device(self) -> torch.device:
        return self.target_positions.device


def _fail(message: str) -> NoReturn:
    raise InvalidArgumentError(message)


def _as_int(name: str, value: Any, minimum: int, maximum: int = _INT32_MAX) -> int:
    if isinstance(value, bool):
        _fail(f"{name} must be an integer, got bool")
    try:
        number = operator.index(value)
    except TypeError:
        _fail(f"{name} must be an integer, got {type(value).__name__}")
    if not minimum <= number <= maximum:
        _fail(f"{name} must be in [{minimum}, {maximum}], got {number}")
    return number


def _check_tensor(
    name: str,
    tensor: Any,
    dtype: torch.dtype,
    ndim: int,
    device: Optional[torch.device],
    contiguous: bool = True,
) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        _fail(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if device is not None and tensor.device != device:
        _fail(f"{name} is on {tensor.device}, but target_positions is on {device}")
    if contiguous and not tensor.is_contiguous():
        _fail(f"{name} must be contiguous")
    return tensor


def _check_block_table(block_table: Any, num_reqs: int, device: torch.device) -> torch.Tensor:
    table = _check_tensor("block_table", block_table, torch.int32, 2, device, contiguous=False)
    rows, width = table.shape
    if rows < num_reqs:
        _fail(f"block_table has {rows} rows, fewer than num_reqs={num_reqs}")
    if width < 1:
        _fail("block_table must have at least one column")
    # Rows may be a slice of a larger persistent table, but each row must be dense.
    if width > 1 and table.stride(1) != 1:
        _fail(f"block_table rows must be contiguous (stride(1) == 1), got {table.stride()}")
    if rows > 1 and table.stride(0) < width:
        _fail(f"block_table row stride {table.stride(0)} is smaller than its width {width}")
    return table


def _check_out(out: Any, num_reqs: int, num_ctx: int, num_spec: int, device: torch.device) -> None:
    if not isinstance(out, DFlashInputs):
        _fail(f"out must be a DFlashInputs, got {type(out).__name__}")
    if out.num_speculative_tokens != num_spec:
        _fail(
            f"out was allocated for num_speculative_tokens={out.num_speculative_tokens}, "
            f"got {num_spec}"
        )
    for field, dtype in BUFFER_DTYPES.items():
        _check_tensor(f"out.{field}", getattr(out, field), dtype, 1, device)
    query_lanes = out.input_ids.numel()
    num_query = num_spec + 1
    if out.query_positions.numel() != query_lanes or out.query_slot_mapping.numel() != query_lanes:
        _fail("out query buffers (input_ids, query_positions, query_slot_mapping) differ in size")
    if query_lanes % num_query != 0:
        _fail(f"out.input_ids has {query_lanes} lanes, not a multiple of K+1={num_query}")
    if query_lanes < num_reqs * num_query:
        _fail(f"out holds {query_lanes // num_query} requests, fewer than num_reqs={num_reqs}")
    if out.token_indices_to_sample.numel() != (query_lanes // num_query) * num_spec:
        _fail("out.token_indices_to_sample must hold K entries per request of out.input_ids")
    if out.context_slot_mapping.numel() != out.context_positions.numel():
        _fail("out context buffers (context_positions, context_slot_mapping) differ in size")
    if out.context_positions.numel() < num_ctx:
        _fail(f"out holds {out.context_positions.numel()} context lanes, fewer than {num_ctx}")
    if query_lanes > _INT32_MAX or out.context_positions.numel() > _INT32_MAX:
        _fail("out buffers must hold fewer than 2**31 lanes")
    slots = num_programs(query_lanes, out.context_positions.numel())
    if out.violation_partials.numel() < slots:
        _fail(
            f"out.violation_partials has {out.violation_partials.numel()} slots, fewer than the "
            f"{slots} programs of a launch over these buffers (allocate with DFlashInputs.empty)"
        )


def check_values(args: ExpandArgs) -> None:
    """Data checks, gathered into one device-to-host copy; details only on failure."""
    qsl = args.query_start_loc.to(torch.int64)
    lengths = qsl[1:] - qsl[:-1]
    no = torch.zeros((), dtype=torch.bool, device=qsl.device)
    rejected = args.num_rejected_tokens
    per_row = args.num_blocks_per_row
    positions = args.target_positions
    flags = {
        "start": qsl[0] != 0,
        "order": (lengths < 0).any(),
        "end": qsl[-1] != args.num_ctx,
        "empty": (lengths <= 0).any(),
        "neg_rejected": (rejected < 0).any() if rejected is not None else no,
        "rejected": (rejected >= lengths).any() if rejected is not None else no,
        "positions": (positions < 0).any() if args.num_ctx else no,
        "per_row": (
            (
                (per_row[: args.num_reqs] < 0)
                | (per_row[: args.num_reqs] > args.block_table.shape[1])
            ).any()
            if per_row is not None and args.num_reqs
            else no
        ),
    }
    failed = dict(zip(flags, torch.stack(list(flags.values())).tolist()))

    def first(mask: torch.Tensor) -> int:
        return int(mask.nonzero()[0, 0])

    if failed["start"]:
        _fail(f"query_start_loc[0] must be 0, got {int(qsl[0])}")
    if failed["order"]:
        r = first(lengths < 0)
        _fail(f"query_start_loc must be non-decreasing, but entry {r + 1} < entry {r}")
    if failed["end"]:
        _fail(
            f"query_start_loc[-1] must equal num_ctx={args.num_ctx} (len(target_positions)), "
            f"got {int(qsl[-1])}"
        )
    if failed["empty"]:
        _fail(f"request {first(lengths <= 0)} has zero context tokens in query_start_loc")
    if failed["neg_rejected"]:
        _fail(f"num_rejected_tokens[{first(rejected < 0)}] is negative")
    if failed["rejected"]:
        r = first(rejected >= lengths)
        _fail(
            f"num_rejected_tokens[{r}]={int(rejected[r])} leaves request {r} no valid context "
            f"token (it has {int(lengths[r])})"
        )
    if failed["positions"]:
        _fail(f"target_positions[{first(positions < 0)}] is negative")
    if failed["per_row"]:
        rows = per_row[: args.num_reqs]
        r = first((rows < 0) | (rows > args.block_table.shape[1]))
        _fail(
            f"num_blocks_per_row[{r}]={int(rows[r])} is outside [0, block_table width="
            f"{args.block_table.shape[1]}]"
        )


def prepare_expand_args(
    next_token_ids: Any,
    target_positions: Any,
    query_start_loc: Any,
    block_table: Any,
    *,
    block_size: Any,
    num_speculative_tokens: Any,
    mask_token_id: Any,
    num_rejected_tokens: Any = None,
    num_blocks_per_row: Any = None,
    max_model_len: Any = None,
    out: Any = None,
    validate: bool = True,
    accumulate_violations: bool = False,
) -> ExpandArgs:
    """Check the arguments of ``expand_dflash_inputs`` and allocate ``out`` when it is None."""
    num_spec = _as_int("num_speculative_tokens", num_speculative_tokens, 1)
    block_size = _as_int("block_size", block_size, 1)
    mask_token_id = _as_int("mask_token_id", mask_token_id, -(2**31))
    if max_model_len is not None:
        if num_blocks_per_row is None:
            _fail("max_model_len is only checked in strict mode: pass num_blocks_per_row too")
        max_model_len = _as_int("max_model_len", max_model_len, 1, 2**62)
    if accumulate_violations:
        if num_blocks_per_row is None:
            _fail("accumulate_violations needs strict mode: pass num_blocks_per_row too")
        if out is None:
            _fail("accumulate_violations needs out= (the counter it adds to)")

    positions = _check_tensor("target_positions", target_positions, torch.int64, 1, None)
    device = positions.device
    next_tokens = _check_tensor("next_token_ids", next_token_ids, torch.int32, 1, device)
    qsl = _check_tensor("query_start_loc", query_start_loc, torch.int32, 1, device)
    num_reqs = next_tokens.numel()
    num_ctx = positions.numel()
    if qsl.numel() != num_reqs + 1:
        _fail(
            f"query_start_loc must have num_reqs + 1 = {num_reqs + 1} entries "
            f"(num_reqs = len(next_token_ids)), got {qsl.numel()}"
        )
    if num_ctx > _INT32_MAX:
        _fail("target_positions must hold fewer than 2**31 tokens")
    table = _check_block_table(block_table, num_reqs, device)

    rejected = None
    if num_rejected_tokens is not None:
        rejected = _check_tensor("num_rejected_tokens", num_rejected_tokens, torch.int32, 1, device)
        if rejected.numel() != num_reqs:
            _fail(
                f"num_rejected_tokens must have num_reqs={num_reqs} entries, got {rejected.numel()}"
            )
    per_row = None
    if num_blocks_per_row is not None:
        per_row = _check_tensor("num_blocks_per_row", num_blocks_per_row, torch.int32, 1, device)
        if per_row.numel() < num_reqs:
            _fail(
                f"num_blocks_per_row has {per_row.numel()} entries, fewer than num_reqs={num_reqs}"
            )

    if out is None:
        out = DFlashInputs.empty(num_reqs, num_ctx, num_spec, device)
    else:
        _check_out(out, num_reqs, num_ctx, num_spec, device)

    args = ExpandArgs(
        next_token_ids=next_tokens,
        target_positions=positions,
        query_start_loc=qsl,
        block_table=table,
        num_rejected_tokens=rejected,
        num_blocks_per_row=per_row,
        num_reqs=num_reqs,
        num_ctx=num_ctx,
        num_speculative_tokens=num_spec,
        block_size=block_size,
        mask_token_id=mask_token_id,
        max_model_len=max_model_len,
        out=out,
        accumulate_violations=bool(accumulate_violations),
    )
    if validate:
        check_values(args)
    return args
