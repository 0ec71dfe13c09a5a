"""``expand_dflash_inputs``: the public entry point, dispatching to Triton or to pure torch."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Literal, Optional

import torch

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels._launch_cache import MAX_PLANS, call_signature, sizes_fit
from dflash_rs.kernels._validate import ExpandArgs, check_values, prepare_expand_args
from dflash_rs.kernels.reference import run_reference
from dflash_rs.kernels.result import DFlashInputs

if TYPE_CHECKING:
    from dflash_rs.kernels.dflash_expand import ExpandLaunch

__all__ = ["Backend", "expand_dflash_inputs", "triton_available"]

Backend = Literal["auto", "triton", "reference"]


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run on ``device`` (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if device.type != "cuda" and not (device.type == "cpu" and _interpreting()):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def expand_dflash_inputs(
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
    backend: Backend = "auto",
    accumulate_violations: bool = False,
) -> DFlashInputs:
    """Expand a step's context into DFlash's ``K + 1`` query lanes per request, with KV slots.

    Inputs (all on one device): ``next_token_ids`` int32 [num_reqs] (bonus/anchor tokens),
    ``target_positions`` int64 [num_ctx], ``query_start_loc`` int32 [num_reqs + 1] (request r's
    context is ``[qsl[r], qsl[r+1])``), ``block_table`` int32 [>= num_reqs, width] (row r is
    request r; rows may be a slice of a larger table, columns must be dense),
    ``num_rejected_tokens`` int32 [num_reqs] (valid context ends at ``qsl[r+1] - rejected[r]``).

    Per request with last valid context position ``p``: input ids ``[next_token_ids[r], mask x
    K]`` at positions ``p+1 .. p+K+1``; context positions are copied; every lane's slot is
    ``table[r, col] * block_size + pos % block_size``.

    Default mode (``num_blocks_per_row`` None) is vLLM's ``copy_and_expand_dflash_inputs_kernel``:
    ``col = min(pos // block_size, width - 1)``, whatever the row holds there. Strict mode
    (``num_blocks_per_row`` int32 [>= num_reqs] given) maps a lane to ``PAD_SLOT_ID`` and counts it
    in ``num_violations`` when ``pos // block_size >= num_blocks_per_row[r]``, when the block id
    there is ``<= 0`` (the null block), or when ``pos >= max_model_len`` (if given); positions are
    written as computed. ``num_violations`` is exact per launch: each of the kernel's programs
    writes its count to its own slot of ``out.violation_partials`` (no atomics, no memset, so a
    CUDA-graph replay needs nothing else), and reading ``num_violations`` sums the slots.
    ``accumulate_violations=True`` (strict mode, with ``out=``) instead adds each program's count
    to its slot, so ``num_violations`` counts every launch since ``out.reset_violations()``.

    ``out``: preallocated buffers (``DFlashInputs.empty``), filled and returned; lanes past the
    batch are padding (see ``DFlashInputs``). With ``validate=False`` no check reads tensor data,
    so the call never synchronises with the device (CUDA-graph capture); a padding request there
    may have an empty context range (its lanes become padding). ``backend="auto"`` runs the Triton
    kernel on CUDA tensors (or CPU tensors under ``TRITON_INTERPRET=1``) and the pure-torch
    reference otherwise. Raises ``InvalidArgumentError`` for bad inputs.

    Repeated calls into the same ``out``: the first call of a signature (the tensors' dtypes,
    devices, dims, contiguity and data-pointer alignment, the table's width and strides, the
    output buffers' metadata, the scalars; not the batch's size) checks the arguments and plans
    the launch; a later call of that signature whose batch fits the buffers checks only the
    sizes, and launches the compiled kernel without Triton's JIT (see
    ``kernels/_launch_cache.py``). Any other change of a buffer, in place included, is checked
    again; ``validate=True`` still checks the data on every call.
    """
    signature = None
    if out is not None and backend != "reference" and isinstance(out, DFlashInputs):
        found = call_signature(
            next_token_ids,
            target_positions,
            query_start_loc,
            block_table,
            num_rejected_tokens,
            num_blocks_per_row,
            out,
            block_size,
            num_speculative_tokens,
            mask_token_id,
            max_model_len,
            accumulate_violations,
            backend,
        )
        if found is not None:
            signature = found[0]
            if _launch_planned(found, out, num_rejected_tokens, num_blocks_per_row, validate):
                return out
    if backend not in ("auto", "triton", "reference"):
        raise InvalidArgumentError(
            f"backend must be 'auto', 'triton' or 'reference', got {backend!r}"
        )
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
    use_triton = backend == "triton" or (backend == "auto" and triton_available(args.device))
    if not use_triton:
        return run_reference(args)
    if not triton_available(args.device):
        raise InvalidArgumentError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 with CPU tensors) and an "
            f"importable triton; tensors are on {args.device}"
        )
    from dflash_rs.kernels.dflash_expand import ExpandLaunch, kernel_tensors

    plan = ExpandLaunch(args)
    plan.launch_jit(kernel_tensors(args), args.num_reqs, args.num_ctx)
    if signature is not None:  # checked and launched: later calls like it launch the plan
        plans = args.out._launch_plans
        if len(plans) >= MAX_PLANS:
            del plans[next(iter(plans))]
        plans[signature] = plan
    return args.out


def _launch_planned(
    found: tuple,
    out: DFlashInputs,
    num_rejected_tokens: Optional[torch.Tensor],
    num_blocks_per_row: Optional[torch.Tensor],
    validate: bool,
) -> bool:
    """Launch the plan of a call's signature (``call_signature``'s result) if there is one and
    the batch fits it; False when the call must take the full path."""
    signature, tensors, pointers, sizes = found
    plan: Optional[ExpandLaunch] = out._launch_plans.get(signature)
    # A CPU plan ran under TRITON_INTERPRET=1, which may have been unset since.
    if (
        plan is None
        or (plan.device_index is None and not _interpreting())
        or not sizes_fit(sizes, plan.max_num_reqs, plan.max_num_ctx)
    ):
        return False
    num_reqs, num_ctx = sizes[0][0], sizes[1][0]
    if validate:
        scalars, constexprs = plan.scalars, plan.constexprs
        check_values(
            ExpandArgs(
                next_token_ids=tensors[0],
                target_positions=tensors[1],
                query_start_loc=tensors[2],
                block_table=tensors[3],
                num_rejected_tokens=num_rejected_tokens,
                num_blocks_per_row=num_blocks_per_row,
                num_reqs=num_reqs,
                num_ctx=num_ctx,
                num_speculative_tokens=constexprs["NUM_SPEC"],
                block_size=constexprs["KV_BLOCK"],
                mask_token_id=scalars[7],
                max_model_len=scalars[8] if constexprs["HAS_MAX_LEN"] else None,
                out=out,
                accumulate_violations=constexprs["ACCUMULATE"],
            )
        )
    plan.launch(tensors, pointers, num_reqs, num_ctx)
    return True
