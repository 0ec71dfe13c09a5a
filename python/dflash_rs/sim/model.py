"""Stand-in target model and drafter: they compute nothing, but write tags into the paged KV
cache exactly where a real model runner would write K/V.

* Target: every scheduled token (drafts included) at ``table[row, p // B] * B + p % B`` (vLLM's
  slot mapping, no clamp).
* DFlash drafter: the expansion kernel maps the step's context (all scheduled tokens) and
  ``K + 1`` query lanes per request (bonus + K masks at ``last+1 .. last+K+1``) to slots. The
  kernel runs twice: in its default mode (vLLM's semantics, whatever the table holds, including
  the null block past a row's count), whose slots are written; and in strict mode, which maps
  every lane outside the row's owned blocks to ``PAD_SLOT_ID`` and counts it (ownership).
  Context lanes are written first, then query lanes, as the real drafter does.
* EAGLE-style drafters (eagle, eagle3, mtp, draft_model): context lanes as the target, then
  ``K - 1`` autoregressive positions ``last+1 .. last+K-1`` through the block table.
* n-gram and suffix decoding have no drafter model and write nothing beyond the target.

A request whose query window would reach ``max_model_len`` does not draft this step (vLLM skips
drafting when ``seq_len + K + 1`` exceeds the drafter's window).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, cast

import numpy as np
import torch

from dflash_rs.sim.batch import StepBatch
from dflash_rs.sim.kv_store import DRAFTER, TARGET, PagedKVStore
from dflash_rs.sim.sampler import SampleResult
from dflash_rs.sim.tags import query_tags
from dflash_rs.sim.workload import MASK_TOKEN_ID

__all__ = ["DFlashKernelRecord", "DrafterPass", "StandInModel", "WriteLanes", "table_slots"]

DRAFTER_METHODS = ("dflash", "eagle", "eagle3", "mtp", "draft_model")


@dataclass
class WriteLanes:
    """Values written to one channel: lane ``j`` wrote ``values[j]`` for batch row ``rows[j]``
    at ``positions[j]`` into ``slots[j]`` (-1: not written)."""

    channel: int
    kind: str
    rows: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    values: np.ndarray

    @staticmethod
    def empty(channel: int, kind: str) -> WriteLanes:
        none = np.empty(0, np.int64)
        return WriteLanes(channel, kind, none, none, none, none)


@dataclass
class DFlashKernelRecord:
    """Both kernel runs of a step, as numpy arrays (for the verifier's consistency checks)."""

    default: dict
    strict: dict
    strict_counter: int
    anchor_tokens: np.ndarray  # int64 [n]: the next_token_ids passed in


@dataclass
class DrafterPass:
    context: WriteLanes
    queries: WriteLanes  # lanes of drafting rows only
    drafting: np.ndarray  # bool [n]
    valid_end: np.ndarray  # int64 [n]: drafter context is valid for positions < valid_end
    ownership_violations: int  # lanes outside the row's owned blocks (strict kernel or table)
    kernel: Optional[DFlashKernelRecord] = None


def table_slots(
    table: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int
) -> np.ndarray:
    """vLLM's slot mapping through a block table, with the kernel's clamp to the last column."""
    cols = np.minimum(positions // block_size, table.shape[1] - 1)
    return table[rows, cols].astype(np.int64) * block_size + positions % block_size


def _table_violations(batch: StepBatch, rows: np.ndarray, positions: np.ndarray) -> int:
    """Lanes whose column is past the row's count or holds the null block."""
    cols = positions // batch.block_size
    width = batch.table.shape[1]
    outside = (cols >= batch.blocks_per_row[rows]) | (cols >= width)
    null = batch.table[rows, np.minimum(cols, width - 1)] <= 0
    return int((outside | null).sum())


def _numpy(result: object) -> dict:
    from dflash_rs.kernels.result import LANE_BUFFERS

    return {f: getattr(result, f).cpu().numpy().astype(np.int64) for f in LANE_BUFFERS}


class StandInModel:
    def __init__(
        self,
        store: PagedKVStore,
        method: str,
        num_speculative_tokens: int,
        max_model_len: int,
        kernel_backend: str = "auto",
        device: str = "cpu",
    ) -> None:
        self.store = store
        self.method = method
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.kernel_backend = kernel_backend
        self.device = torch.device(device)

    @property
    def has_drafter(self) -> bool:
        return self.method in DRAFTER_METHODS

    def forward_target(self, batch: StepBatch) -> WriteLanes:
        """Write every scheduled token's content tag into the target channel."""
        slots = table_slots(batch.table, batch.rows, batch.positions, batch.block_size)
        lanes = WriteLanes(TARGET, "target", batch.rows, batch.positions, slots, batch.tags)
        self._write(batch, lanes)
        return lanes

    def forward_drafter(self, batch: StepBatch, sample: SampleResult) -> Optional[DrafterPass]:
        """Run the drafter's KV writes for the step (after sampling, as vLLM does)."""
        if not self.has_drafter:
            return None
        valid_end = batch.end - sample.num_rejected.astype(np.int64)
        if self.method == "dflash":
            drafter = self._dflash(batch, sample, valid_end)
        else:
            drafter = self._autoregressive(batch, valid_end)
        self._write(batch, drafter.context)
        self._write(batch, drafter.queries)
        return drafter

    def _write(self, batch: StepBatch, lanes: WriteLanes) -> None:
        writers = batch.owner[lanes.rows]
        self.store.write(lanes.channel, lanes.slots, lanes.values, writers, lanes.positions)

    def _query_lanes(
        self, batch: StepBatch, rows: np.ndarray, positions: np.ndarray, slots: np.ndarray
    ) -> WriteLanes:
        values = query_tags(batch.owner[rows], positions, batch.step)
        return WriteLanes(DRAFTER, "drafter-query", rows, positions, slots, values)

    def _autoregressive(self, batch: StepBatch, valid_end: np.ndarray) -> DrafterPass:
        context_slots = table_slots(batch.table, batch.rows, batch.positions, batch.block_size)
        context = WriteLanes(
            DRAFTER, "drafter-context", batch.rows, batch.positions, context_slots, batch.tags
        )
        extra = max(self.k - 1, 0)
        drafting = valid_end + extra <= self.max_model_len
        rows = np.repeat(np.flatnonzero(drafting), extra)
        offsets = np.tile(np.arange(extra, dtype=np.int64), int(drafting.sum()))
        positions = valid_end[rows] + offsets
        slots = table_slots(batch.table, rows, positions, batch.block_size)
        violations = _table_violations(batch, batch.rows, batch.positions)
        violations += _table_violations(batch, rows, positions)
        queries = self._query_lanes(batch, rows, positions, slots)
        return DrafterPass(context, queries, drafting, valid_end, violations)

    def _dflash(self, batch: StepBatch, sample: SampleResult, valid_end: np.ndarray) -> DrafterPass:
        from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs
        from dflash_rs.kernels.api import Backend

        device = self.device
        next_tokens = torch.from_numpy(sample.anchor_tokens).to(device)
        positions = torch.from_numpy(batch.positions).to(device)
        query_start_loc = torch.from_numpy(batch.query_start_loc).to(device)
        table = batch.table_tensor.to(device)
        rejected = torch.from_numpy(sample.num_rejected).to(device)
        per_row = torch.from_numpy(batch.blocks_per_row.astype(np.int32)).to(device)

        def expand(strict: bool) -> DFlashInputs:
            return expand_dflash_inputs(
                next_tokens,
                positions,
                query_start_loc,
                table,
                block_size=batch.block_size,
                num_speculative_tokens=self.k,
                mask_token_id=MASK_TOKEN_ID,
                num_rejected_tokens=rejected,
                num_blocks_per_row=per_row if strict else None,
                max_model_len=self.max_model_len if strict else None,
                validate=not strict,  # the strict run sees the inputs the default run checked
                backend=cast(Backend, self.kernel_backend),
            )

        default, strict = expand(strict=False), expand(strict=True)
        record = DFlashKernelRecord(
            _numpy(default),
            _numpy(strict),
            int(strict.num_violations),
            sample.anchor_tokens.astype(np.int64),
        )

        num_query = self.k + 1
        # The last query position is valid_end + K; it must stay below max_model_len.
        drafting = valid_end + self.k < self.max_model_len
        context = WriteLanes(
            DRAFTER,
            "drafter-context",
            batch.rows,
            record.default["context_positions"],
            record.default["context_slot_mapping"],
            batch.tags,
        )
        lane_rows = np.repeat(np.arange(batch.num_reqs, dtype=np.int64), num_query)
        keep = drafting[lane_rows]
        rows = lane_rows[keep]
        queries = self._query_lanes(
            batch,
            rows,
            record.default["query_positions"][keep],
            record.default["query_slot_mapping"][keep],
        )
        violations = int((record.strict["context_slot_mapping"] < 0).sum())
        violations += int((record.strict["query_slot_mapping"][keep] < 0).sum())
        return DrafterPass(context, queries, drafting, valid_end, violations, record)
