"""One step's batch: the scheduler's output as flat arrays, plus the tags its tokens imply."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from dflash_rs.sim.ledger import Ledger, TrackedRequest

__all__ = ["SchedulerContractError", "StepBatch", "table_as_tensor"]

TablePatch = Callable[[int, Any], Optional[np.ndarray]]


class SchedulerContractError(RuntimeError):
    """The scheduler's output contradicts the engine's own record of a request."""


def table_as_tensor(table: np.ndarray) -> torch.Tensor:
    """The block table as a torch tensor sharing its memory (no copy).

    The scheduler's view is read-only; torch warns that it cannot mark tensors read-only. The
    simulation never writes through this tensor.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(table)


@dataclass
class StepBatch:
    """Batch row ``i`` is request ``req_ids[i]``; token arrays are flat in batch order."""

    step: int
    block_size: int
    req_ids: List[str]
    requests: List[TrackedRequest]
    owner: np.ndarray  # int64 [n]: ledger index of each row's request
    table: np.ndarray  # int32 [n, width]: the scheduler's zero-copy view (or a patched copy)
    blocks_per_row: np.ndarray  # int64 [n]
    num_computed: np.ndarray  # int64 [n], before this step
    num_scheduled: np.ndarray  # int64 [n]
    query_start_loc: np.ndarray  # int32 [n + 1]
    is_prefill_chunk: np.ndarray  # bool [n]
    spec_tokens: List[List[int]]  # scheduled drafts per row
    rows: np.ndarray  # int64 [T]: row of each scheduled token
    positions: np.ndarray  # int64 [T]
    tags: np.ndarray  # int64 [T]: content tags of the scheduled tokens (drafts included)
    context_tags: List[np.ndarray]  # per row: content tags of positions 0 .. end - 1

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def end(self) -> np.ndarray:
        """Per row, one past the last position scheduled this step."""
        return self.num_computed + self.num_scheduled

    @property
    def table_tensor(self) -> torch.Tensor:
        return table_as_tensor(self.table)

    @classmethod
    def from_output(
        cls,
        out: Any,
        ledger: Ledger,
        step: int,
        block_size: int,
        patch_table: Optional[TablePatch] = None,
    ) -> StepBatch:
        req_ids = list(out.req_ids)
        n = len(req_ids)
        requests = [ledger[rid] for rid in req_ids]
        table = out.block_table
        if patch_table is not None:
            patched = patch_table(step, out)
            table = table if patched is None else patched
        num_computed = out.num_computed_tokens.astype(np.int64)
        num_scheduled = out.num_scheduled_tokens_array.astype(np.int64)
        qsl = np.array(out.query_start_loc, dtype=np.int32)
        spec_by_id = out.scheduled_spec_decode_tokens
        spec_tokens: List[List[int]] = []
        step_tags: List[np.ndarray] = []
        context_tags: List[np.ndarray] = []
        for i, tracked in enumerate(requests):
            start, end = int(num_computed[i]), int(num_computed[i] + num_scheduled[i])
            spec = list(spec_by_id.get(tracked.request_id, ()))
            committed = min(end, tracked.num_tokens)
            if end - committed != len(spec) or start > tracked.num_tokens:
                raise SchedulerContractError(
                    f"step {step}: {tracked.request_id!r} has {tracked.num_tokens} tokens and "
                    f"{len(spec)} scheduled drafts, but positions {start}..{end - 1} were "
                    "scheduled"
                )
            spec_tags = tracked.speculative_tags(spec)
            context = np.concatenate([tracked.tags[:committed], spec_tags])
            spec_tokens.append(spec)
            context_tags.append(context)
            step_tags.append(context[start:end])
        rows = np.repeat(np.arange(n, dtype=np.int64), num_scheduled)
        starts = np.repeat(qsl[:-1].astype(np.int64), num_scheduled)
        positions = np.arange(len(rows), dtype=np.int64) - starts + num_computed[rows]
        return cls(
            step=step,
            block_size=block_size,
            req_ids=req_ids,
            requests=requests,
            owner=np.array([r.index for r in requests], dtype=np.int64),
            table=table,
            blocks_per_row=out.num_blocks_per_row.astype(np.int64),
            num_computed=num_computed,
            num_scheduled=num_scheduled,
            query_start_loc=qsl,
            is_prefill_chunk=np.array(out.is_prefill_chunk, dtype=bool),
            spec_tokens=spec_tokens,
            rows=rows,
            positions=positions,
            tags=np.concatenate(step_tags) if step_tags else np.empty(0, np.int64),
            context_tags=context_tags,
        )
