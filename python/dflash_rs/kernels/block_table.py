"""The step's block table as tensors: a zero-copy view of the scheduler's arrays
(``shared_tensor``), and a device copy kept up to date incrementally (``DeviceBlockTable``).

The scheduler hands out a read-only int32 view of the step's block-table snapshot (row ``i`` is
``req_ids[i]``; unchanged for as long as it is held) and the block count of each row. On CPU
the kernel reads that memory directly; on a GPU a :class:`DeviceBlockTable` copies only the
rows that changed since the previous step.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from dflash_rs._arith import cdiv
from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels.result import DeviceLike

__all__ = ["BlockTableCopyStats", "DeviceBlockTable", "shared_tensor"]

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
        width = cdiv(config.max_model_len, config.block_size)
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
