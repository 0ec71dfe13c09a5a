"""From a ``SchedulerOutput`` to the DFlash expansion kernel's inputs.

The scheduler hands out flat numpy arrays: the step's block-table snapshot and row counts
(see :mod:`~dflash_rs.kernels.block_table`), the computed tokens before the step and the tokens
scheduled per request. The kernel wants torch tensors on one device:

* ``target_positions`` of the step's context tokens: request ``i`` contributes
  ``num_computed_tokens[i] + arange(num_scheduled[i])`` (prompt chunk, or the last token plus
  the drafts being verified), computed without a Python loop over requests;
* ``query_start_loc`` as given (request ``i``'s context is ``[qsl[i], qsl[i+1])``);
* ``block_table`` / ``num_blocks_per_row``: on CPU the scheduler's own memory (no copy); on a
  GPU a :class:`~dflash_rs.kernels.block_table.DeviceBlockTable` keeps a device copy up to
  date by copying only the rows that changed since the previous step.

``expand_from_output`` chains ``kernel_inputs_from_output`` and ``expand_dflash_inputs``;
``strict=True`` passes the row counts (and ``max_model_len``) so that any lane outside the
row's owned blocks is reported instead of silently clamped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels.api import Backend, expand_dflash_inputs
from dflash_rs.kernels.block_table import DeviceBlockTable, shared_tensor
from dflash_rs.kernels.result import DeviceLike, DFlashInputs

__all__ = ["KernelInputs", "context_positions", "expand_from_output", "kernel_inputs_from_output"]


def context_positions(
    num_computed_tokens: np.ndarray, num_scheduled_tokens: np.ndarray
) -> np.ndarray:
    """int64 positions of a step's scheduled tokens, in batch order (vectorised).

    Request ``i`` contributes ``num_computed_tokens[i] + arange(num_scheduled_tokens[i])``.
    """
    computed = np.asarray(num_computed_tokens, dtype=np.int64)
    scheduled = np.asarray(num_scheduled_tokens, dtype=np.int64)
    if computed.shape != scheduled.shape or computed.ndim != 1:
        raise InvalidArgumentError(
            f"num_computed_tokens {computed.shape} and num_scheduled_tokens {scheduled.shape} "
            "must be 1-D arrays of one length"
        )
    if (scheduled < 0).any():
        raise InvalidArgumentError("num_scheduled_tokens must be non-negative")
    starts = np.cumsum(scheduled) - scheduled
    total = int(scheduled.sum())
    # Position of token t of request i: computed[i] + (t - starts[i]).
    return np.arange(total, dtype=np.int64) + np.repeat(computed - starts, scheduled)


@dataclass(frozen=True)
class KernelInputs:
    """Tensors ``expand_dflash_inputs`` takes for one step, all on one device.

    On CPU ``block_table`` and ``num_blocks_per_row`` share memory with the step's read-only
    block-table snapshot: never write to them.
    """

    next_token_ids: torch.Tensor  # int32 [num_reqs]
    target_positions: torch.Tensor  # int64 [num_ctx]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    block_table: torch.Tensor  # int32 [num_reqs, width]
    num_blocks_per_row: torch.Tensor  # int32 [num_reqs]
    num_rejected_tokens: Optional[torch.Tensor]  # int32 [num_reqs] or None

    @property
    def num_reqs(self) -> int:
        return self.next_token_ids.numel()

    @property
    def num_ctx(self) -> int:
        return self.target_positions.numel()

    @property
    def device(self) -> torch.device:
        return self.target_positions.device


def _per_request(name: str, values: Any, num_reqs: int, device: torch.device) -> torch.Tensor:
    """A 1-D int32 tensor of ``num_reqs`` entries on ``device`` from a tensor, array or list."""
    if isinstance(values, torch.Tensor):
        tensor = values
    else:
        array = np.asarray(values)
        if array.dtype.kind not in "iu" and array.size:
            raise InvalidArgumentError(f"{name} must hold integers, got dtype {array.dtype}")
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    if tensor.dim() != 1 or tensor.numel() != num_reqs:
        raise InvalidArgumentError(
            f"{name} must have one entry per scheduled request ({num_reqs}), "
            f"got shape {tuple(tensor.shape)}"
        )
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise InvalidArgumentError(f"{name} must hold integers, got {tensor.dtype}")
    return tensor.to(device=device, dtype=torch.int32).contiguous()


def _resolve_device(
    device: Optional[DeviceLike], block_table: Optional[DeviceBlockTable], next_token_ids: Any
) -> torch.device:
    if device is not None:
        return torch.device(device)
    if block_table is not None:
        return block_table.device
    if isinstance(next_token_ids, torch.Tensor):
        return next_token_ids.device
    return torch.device("cpu")


def kernel_inputs_from_output(
    output: Any,
    *,
    next_token_ids: Any,
    num_rejected_tokens: Any = None,
    device: Optional[DeviceLike] = None,
    block_table: Optional[DeviceBlockTable] = None,
) -> KernelInputs:
    """The kernel's inputs for the step described by ``output`` (a ``SchedulerOutput``).

    ``next_token_ids``: per request, the drafter's anchor (the bonus token just sampled, or for a
    prefill chunk the next prompt token). ``num_rejected_tokens``: per request, the drafts this
    step's verification rejected (their positions are still in the context; the valid context
    ends before them). Both may be tensors, numpy arrays or sequences, in batch order.

    ``device`` defaults to ``block_table``'s device, else ``next_token_ids``' device, else CPU.
    On CPU the block table and row counts share memory with the step's snapshot. On
    another device pass a :class:`DeviceBlockTable` (``block_table=``) to copy only the rows
    that changed since the previous step; without one the table is copied whole.
    """
    target = _resolve_device(device, block_table, next_token_ids)
    num_reqs = len(output.req_ids)
    computed = np.asarray(output.num_computed_tokens)
    scheduled = np.asarray(output.num_scheduled_tokens_array)
    qsl_array = np.asarray(output.query_start_loc)
    if computed.shape != (num_reqs,) or scheduled.shape != (num_reqs,):
        raise InvalidArgumentError("output's per-request arrays do not match its req_ids")
    if qsl_array.shape != (num_reqs + 1,):
        raise InvalidArgumentError(
            f"output.query_start_loc must have {num_reqs + 1} entries, got {qsl_array.shape}"
        )
    positions = torch.from_numpy(context_positions(computed, scheduled))
    qsl = shared_tensor(np.ascontiguousarray(qsl_array, dtype=np.int32))

    if block_table is not None:
        if block_table.device != target:
            raise InvalidArgumentError(
                f"block_table lives on {block_table.device}, but the inputs go to {target}"
            )
        table, counts = block_table.update(output)
    else:
        table = shared_tensor(output.block_table)
        counts = shared_tensor(output.num_blocks_per_row)
        if target.type != "cpu":
            table, counts = table.to(target), counts.to(target)
    if table.shape[0] != num_reqs or counts.shape != (num_reqs,):
        raise InvalidArgumentError(
            f"block table has {table.shape[0]} rows and {counts.shape} counts for {num_reqs} "
            "requests"
        )

    rejected = None
    if num_rejected_tokens is not None:
        rejected = _per_request("num_rejected_tokens", num_rejected_tokens, num_reqs, target)
    return KernelInputs(
        next_token_ids=_per_request("next_token_ids", next_token_ids, num_reqs, target),
        target_positions=positions.to(target),
        query_start_loc=qsl.to(target),
        block_table=table,
        num_blocks_per_row=counts,
        num_rejected_tokens=rejected,
    )


def _compiled_triton() -> bool:
    """Whether Triton kernels run compiled on a GPU here (not under the interpreter)."""
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def expand_from_output(
    output: Any,
    config: Any = None,
    *,
    next_token_ids: Any,
    mask_token_id: int,
    num_rejected_tokens: Any = None,
    block_size: Optional[int] = None,
    num_speculative_tokens: Optional[int] = None,
    max_model_len: Optional[int] = None,
    strict: bool = False,
    device: Optional[DeviceLike] = None,
    block_table: Optional[DeviceBlockTable] = None,
    out: Optional[DFlashInputs] = None,
    validate: bool = True,
    backend: Backend = "auto",
) -> DFlashInputs:
    """``kernel_inputs_from_output`` followed by ``expand_dflash_inputs``.

    ``config`` (a ``SchedulerConfig``, e.g. ``scheduler.config``) supplies ``block_size``,
    ``num_speculative_tokens`` and ``max_model_len`` unless they are given. ``strict=True`` runs
    the kernel's strict mode with the rows' block counts and ``max_model_len``: lanes outside
    the blocks a row owns get ``PAD_SLOT_ID`` and are counted in ``num_violations``.
    """
    if config is not None:
        block_size = config.block_size if block_size is None else block_size
        if num_speculative_tokens is None:
            num_speculative_tokens = config.num_speculative_tokens
        max_model_len = config.max_model_len if max_model_len is None else max_model_len
    if block_size is None or num_speculative_tokens is None:
        raise InvalidArgumentError(
            "expand_from_output needs block_size and num_speculative_tokens (or a config)"
        )
    if device is None and block_table is None and backend == "triton" and _compiled_triton():
        device = "cuda"  # the compiled kernel needs device tensors
    inputs = kernel_inputs_from_output(
        output,
        next_token_ids=next_token_ids,
        num_rejected_tokens=num_rejected_tokens,
        device=device,
        block_table=block_table,
    )
    return expand_dflash_inputs(
        inputs.next_token_ids,
        inputs.target_positions,
        inputs.query_start_loc,
        inputs.block_table,
        block_size=block_size,
        num_speculative_tokens=num_speculative_tokens,
        mask_token_id=mask_token_id,
        num_rejected_tokens=inputs.num_rejected_tokens,
        num_blocks_per_row=inputs.num_blocks_per_row if strict else None,
        max_model_len=max_model_len if strict else None,
        out=out,
        validate=validate,
        backend=backend,
    )
