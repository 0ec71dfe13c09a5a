"""Glue from a ``SchedulerOutput`` to the DFlash expansion kernel's inputs.

The scheduler hands out flat numpy arrays: a read-only int32 view of the step's block-table
snapshot (row ``i`` is ``req_ids[i]``; unchanged for as long as it is held), the block count
of each row, the computed tokens before the step and the tokens scheduled per request. The
kernel wants torch tensors on one device:

* ``target_positions`` of the step's context tokens: request ``i`` contributes
  ``num_computed_tokens[i] + arange(num_scheduled[i])`` (prompt chunk, or the last token plus
  the drafts being verified), computed without a Python loop over requests;
* ``query_start_loc`` as given (request ``i``'s context is ``[qsl[i], qsl[i+1])``);
* ``block_table`` / ``num_blocks_per_row``: on CPU the scheduler's own memory (no copy); on a
  GPU a :class:`DeviceBlockTable` keeps a device copy up to date by copying only the rows that
  changed since the previous step.

``expand_from_output`` chains the glue and ``expand_dflash_inputs``; ``strict=True`` passes the
row counts (and ``max_model_len``) so that any lane outside the row's owned blocks is reported
instead of silently clamped.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import torch

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels.api import Backend, expand_dflash_inputs
from dflash_rs.kernels.result import DFlashInputs

__all__ = [
    "BlockTableCopyStats",
    "DeviceBlockTable",
    "KernelInputs",
    "context_positions",
    "expand_from_output",
    "kernel_inputs_from_output",
    "shared_tensor",
]

DeviceLike = Union[torch.device, str, int]

# torch's message for ``from_numpy`` of a non-writable array (emitted once per process).
_NOT_WRITABLE = "The given NumPy array is not writable"


def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """``torch.from_numpy(array)`` without a copy, also for read-only arrays.

    The scheduler's block table and row counts are read-only views of its own buffers. torch has
    no read-only tensors and warns about them; the returned tensor must be treated as
    read-only (nothing in dflash-rs writes through it), so exactly that warning is silenced,
    here and nowhere else.
    """
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning)
        return torch.from_numpy(array)  # read-only: never written through


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


@dataclass(frozen=True)
class BlockTableCopyStats:
    """What one ``DeviceBlockTable.update`` copied to the device."""

    rows: int = 0  # table rows copied (exactly the rows that changed)
    copies: int = 0  # host-to-device copies of table rows issued (row ranges, or 1 gather)
    table_bytes: int = 0  # bytes of table data sent (plus row indices on the gather path)
    counts_bytes: int = 0  # bytes of row counts sent

    @property
    def bytes(self) -> int:
        return self.table_bytes + self.counts_bytes


class DeviceBlockTable:
    """A device copy of the scheduler's block table, updated incrementally.

    Holds a persistent host buffer (pinned on CUDA) that mirrors a device tensor of the full
    ``[max_num_reqs, width]`` table, plus both copies of the row counts. ``update(output)``
    compares the step's first ``num_reqs`` rows and counts with the host mirror (vectorised),
    copies only the rows that changed into it, and sends those rows to the device with
    ``non_blocking`` copies: one copy per run of consecutive changed rows, or, when the changed
    rows form more than ``max_ranges`` runs, one copy of the gathered rows plus an
    ``index_copy_`` on the device. Before it rewrites the host buffers it waits for the previous
    step's copies (a CUDA event), so in-flight copies never read half-updated memory. Call
    ``update`` on the stream that consumes the table (the copies are ordered on the current
    stream, after the previous step's kernels that read it).

    The comparison reads columns ``[0, max(count))`` only: the scheduler's table holds 0 past a
    row's count (its contract, ``block_table.rs``), and so does the mirror, which only ever
    receives whole rows of that table.

    On CPU the default is no mirror at all: ``update`` returns zero-copy views of the
    scheduler's arrays. ``mirror=True`` on CPU keeps the mirror and a separate CPU "device"
    tensor, so the copy logic can be exercised without a GPU.
    """

    def __init__(
        self,
        max_num_reqs: int,
        width: int,
        device: Optional[DeviceLike] = None,
        *,
        mirror: Optional[bool] = None,
        pin_memory: Optional[bool] = None,
        max_ranges: int = 4,
    ) -> None:
        if max_num_reqs < 1 or width < 1:
            raise InvalidArgumentError("max_num_reqs and width must be >= 1")
        if max_ranges < 0:
            raise InvalidArgumentError("max_ranges must be >= 0")
        self.device = torch.device("cpu" if device is None else device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_num_reqs = max_num_reqs
        self.width = width
        self.max_ranges = max_ranges
        self.mirror = self.device.type != "cpu" if mirror is None else bool(mirror)
        if not self.mirror and self.device.type != "cpu":
            raise InvalidArgumentError("a DeviceBlockTable on a GPU always keeps a host mirror")
        self.last_copy = BlockTableCopyStats()
        self.total_rows_copied = 0
        self.total_bytes_copied = 0
        self.num_updates = 0
        self._event: Optional[Any] = None
        if not self.mirror:
            return
        pin = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        shape = (max_num_reqs, width)

        def host(*size: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(size, dtype=dtype, pin_memory=pin)

        self.host_table = host(*shape)
        self.host_counts = host(max_num_reqs)
        self._stage_rows = host(*shape)
        self._stage_index = host(max_num_reqs, dtype=torch.int64)
        self.table = torch.zeros(shape, dtype=torch.int32, device=self.device)
        self.counts = torch.zeros(max_num_reqs, dtype=torch.int32, device=self.device)
        self._dev_stage_rows = torch.empty(shape, dtype=torch.int32, device=self.device)
        self._dev_stage_index = torch.empty(max_num_reqs, dtype=torch.int64, device=self.device)
        self._host_table_np = self.host_table.numpy()
        self._host_counts_np = self.host_counts.numpy()
        self._stage_rows_np = self._stage_rows.numpy()
        self._stage_index_np = self._stage_index.numpy()

    @classmethod
    def from_config(
        cls, config: Any, device: Optional[DeviceLike] = None, **kwargs: Any
    ) -> DeviceBlockTable:
        """Sized for a ``SchedulerConfig``: ``max_num_seqs`` rows, ``cdiv(max_model_len,
        block_size)`` columns (the scheduler's table width)."""
        width = -(-config.max_model_len // config.block_size)
        return cls(config.max_num_seqs, width, device, **kwargs)

    def update(self, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the device table up to date with ``output``; returns its first ``num_reqs``
        rows and counts (views; valid until the next ``update``)."""
        return self.update_from_arrays(output.block_table, output.num_blocks_per_row)

    def update_from_arrays(
        self, block_table: np.ndarray, num_blocks_per_row: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``update`` from the two arrays (int32 ``[num_reqs, width]`` and ``[num_reqs]``)."""
        table = np.asarray(block_table)
        counts = np.asarray(num_blocks_per_row)
        n = table.shape[0] if table.ndim == 2 else -1
        if table.ndim != 2 or table.shape[1] != self.width or n > self.max_num_reqs:
            raise InvalidArgumentError(
                f"block table of shape {table.shape} does not fit [{self.max_num_reqs}, "
                f"{self.width}]"
            )
        if counts.shape != (n,):
            raise InvalidArgumentError(f"num_blocks_per_row has shape {counts.shape}, not ({n},)")
        if table.dtype != np.int32 or counts.dtype != np.int32:
            raise InvalidArgumentError(
                f"block table and counts must be int32, got {table.dtype} and {counts.dtype}"
            )
        self.num_updates += 1
        if not self.mirror:
            self.last_copy = BlockTableCopyStats()
            return shared_tensor(table), shared_tensor(counts)

        self._wait_previous_copies()
        host = self._host_table_np[:n]
        host_counts = self._host_counts_np[:n]
        changed = counts != host_counts
        width = int(max(counts.max(initial=0), host_counts.max(initial=0)))
        if width:
            changed |= (table[:, :width] != host[:, :width]).any(axis=1)
        rows = np.flatnonzero(changed)
        table_bytes, copies = self._copy_rows(table, rows)
        counts_bytes = 0
        if n:
            host_counts[:] = counts
            self.counts[:n].copy_(self.host_counts[:n], non_blocking=True)
            counts_bytes = n * 4
        self._record_copies()
        self.last_copy = BlockTableCopyStats(int(rows.size), copies, table_bytes, counts_bytes)
        self.total_rows_copied += int(rows.size)
        self.total_bytes_copied += self.last_copy.bytes
        return self.table[:n], self.counts[:n]

    def _copy_rows(self, table: np.ndarray, rows: np.ndarray) -> tuple[int, int]:
        """Copy ``rows`` of ``table`` into the mirror and to the device; (bytes, copies)."""
        if not rows.size:
            return 0, 0
        row_bytes = self.width * 4
        self._host_table_np[rows] = table[rows]
        breaks = np.flatnonzero(np.diff(rows) > 1)
        starts = np.concatenate([rows[:1], rows[breaks + 1]])
        ends = np.concatenate([rows[breaks], rows[-1:]]) + 1
        if starts.size <= self.max_ranges:
            for start, end in zip(starts.tolist(), ends.tolist()):
                self.table[start:end].copy_(self.host_table[start:end], non_blocking=True)
            return int(rows.size) * row_bytes, int(starts.size)
        m = int(rows.size)
        np.take(table, rows, axis=0, out=self._stage_rows_np[:m])
        self._stage_index_np[:m] = rows
        dev_rows, dev_index = self._dev_stage_rows[:m], self._dev_stage_index[:m]
        dev_rows.copy_(self._stage_rows[:m], non_blocking=True)
        dev_index.copy_(self._stage_index[:m], non_blocking=True)
        self.table.index_copy_(0, dev_index, dev_rows)
        return m * row_bytes + m * 8, 1

    def _wait_previous_copies(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def _record_copies(self) -> None:
        if self.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(self.device))
