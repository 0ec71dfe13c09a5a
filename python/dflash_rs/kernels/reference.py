"""Pure-torch DFlash input expansion: the executable specification of the Triton kernel.

Vectorised over lanes (no per-request Python loop); used where Triton cannot run and as the
oracle the kernel is tested against. Semantics are documented on ``expand_dflash_inputs``.
"""

from __future__ import annotations

from typing import Optional

import torch

from dflash_rs.kernels._validate import ExpandArgs, prepare_expand_args
from dflash_rs.kernels.result import PAD_POSITION, PAD_SLOT_ID, PAD_TOKEN_ID, DFlashInputs

__all__ = ["expand_dflash_inputs_reference", "run_reference"]


def _with_dummy(values: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Append one entry, so lanes past the batch can index per-request arrays safely."""
    return torch.cat([values, values.new_full((1,), fill)])


def _slot_mapping(
    args: ExpandArgs, rows: torch.Tensor, positions: torch.Tensor, live: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of ``positions`` through table row ``rows``; returns (slots, violating-lane mask)."""
    table = args.block_table
    if args.num_reqs == 0:
        return torch.full_like(positions, PAD_SLOT_ID), torch.zeros_like(live)
    width = table.shape[1]
    rows = rows.clamp(0, args.num_reqs - 1)
    logical_block = torch.div(positions, args.block_size, rounding_mode="floor")
    offset = positions - logical_block * args.block_size
    if args.strict:
        assert args.num_blocks_per_row is not None
        owned_blocks = args.num_blocks_per_row.to(torch.int64)[rows]
        block_id = table[rows, logical_block.clamp(0, width - 1)].to(torch.int64)
        ok = live & (positions >= 0) & (logical_block < width) & (logical_block < owned_blocks)
        ok &= block_id > 0
        if args.max_model_len is not None:
            ok &= positions < args.max_model_len
        violations = live & ~ok
    else:
        # vLLM's silent clamp to the row's last column; negative positions get no slot.
        block_id = table[rows, logical_block.clamp(0, width - 1)].to(torch.int64)
        ok = live & (positions >= 0)
        violations = torch.zeros_like(live)
    slots = torch.where(ok, block_id * args.block_size + offset, PAD_SLOT_ID)
    return slots, violations


def _expand_queries(args: ExpandArgs) -> torch.Tensor:
    """Fill the query buffers; returns the violating-lane mask."""
    out, device = args.out, args.device
    num_reqs, num_ctx = args.num_reqs, args.num_ctx
    num_spec = args.num_speculative_tokens
    num_query = num_spec + 1
    qsl = args.query_start_loc.to(torch.int64)
    starts, ends = qsl[:-1], qsl[1:]
    if args.num_rejected_tokens is not None:
        valid_ends = ends - args.num_rejected_tokens.to(torch.int64)
    else:
        valid_ends = ends
    # A request without a valid context token (a CUDA-graph padding request) is all padding.
    live_reqs = (valid_ends > starts) & (valid_ends <= ends) & (valid_ends >= 1)
    live_reqs &= valid_ends <= num_ctx
    if num_ctx:
        last_positions = args.target_positions[(valid_ends - 1).clamp(0, num_ctx - 1)]
    else:
        last_positions = torch.zeros_like(valid_ends)

    lanes = torch.arange(out.input_ids.numel(), device=device, dtype=torch.int64)
    rows = torch.div(lanes, num_query, rounding_mode="floor")
    query_index = lanes - rows * num_query
    request = rows.clamp(max=num_reqs)
    live = _with_dummy(live_reqs, False)[request]
    positions = _with_dummy(last_positions)[request] + 1 + query_index
    slots, violations = _slot_mapping(args, rows, positions, live)

    bonus = _with_dummy(args.next_token_ids)[request]
    input_ids = torch.where(query_index == 0, bonus, args.mask_token_id)
    out.input_ids.copy_(torch.where(live, input_ids, PAD_TOKEN_ID))
    out.query_positions.copy_(torch.where(live, positions, PAD_POSITION))
    out.query_slot_mapping.copy_(slots)

    samples = torch.arange(out.token_indices_to_sample.numel(), device=device, dtype=torch.int64)
    sample_rows = torch.div(samples, num_spec, rounding_mode="floor")
    out.token_indices_to_sample.copy_(
        sample_rows * num_query + (samples - sample_rows * num_spec) + 1
    )
    return violations


def _expand_context(args: ExpandArgs) -> torch.Tensor:
    """Fill the context buffers; returns the violating-lane mask."""
    out, device = args.out, args.device
    qsl = args.query_start_loc.to(torch.int64)
    lanes = torch.arange(out.context_positions.numel(), device=device, dtype=torch.int64)
    in_batch = lanes < args.num_ctx
    positions = torch.full_like(lanes, PAD_POSITION)
    positions[: args.num_ctx] = args.target_positions
    rows = torch.searchsorted(qsl[: args.num_reqs].contiguous(), lanes, right=True) - 1
    owned = in_batch & (lanes >= qsl[0]) & (lanes < qsl[args.num_reqs])
    slots, violations = _slot_mapping(args, rows, positions, owned)
    out.context_positions.copy_(positions)
    out.context_slot_mapping.copy_(slots)
    return violations


def run_reference(args: ExpandArgs) -> DFlashInputs:
    """Fill ``args.out`` with the pure-torch expansion and return it."""
    violations = (_expand_queries(args).sum() + _expand_context(args).sum()).reshape(1)
    partials = args.out.violation_partials
    if args.accumulate_violations:
        partials[:1].add_(violations.to(torch.int32))
    else:
        # Same convention as the kernel: every slot written, the count in slot 0.
        partials.zero_()
        partials[:1].copy_(violations)
    return args.out


def expand_dflash_inputs_reference(
    next_token_ids: torch.Tensor,
    target_positions: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_table: torch.Tensor,
    *,
    block_size: int,
    num_speculative_tokens: int,
    mask_token_id: int,
    num_rejected_tokens: Optional[torch.Tensor] = None,
    num_blocks_per_row: Optional[torch.Tensor] = None,
    max_model_len: Optional[int] = None,
    out: Optional[DFlashInputs] = None,
    validate: bool = True,
    accumulate_violations: bool = False,
) -> DFlashInputs:
    """Pure-torch ``expand_dflash_inputs`` (same arguments, same results)."""
    args = prepare_expand_args(
        next_token_ids,
        target_positions,
        query_start_loc,
        block_table,
        block_size=block_size,
        num_speculative_tokens=num_speculative_tokens,
        mask_token_id=mask_token_id,
        num_rejected_tokens=num_rejected_tokens,
        num_blocks_per_row=num_blocks_per_row,
        max_model_len=max_model_len,
        out=out,
        validate=validate,
        accumulate_violations=accumulate_violations,
    )
    return run_reference(args)
