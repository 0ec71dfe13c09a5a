"""The ownership contract checked on each step's block table: the lookahead table
(``required_lookahead``) and the checks themselves (``OwnershipCheck``)."""

from __future__ import annotations

from typing import Any, List

import numpy as np

from dflash_rs import Scheduler
from dflash_rs._arith import cdiv
from dflash_rs.errors import InvariantError
from dflash_rs.soak.config import SoakConfig

__all__ = ["OwnershipCheck", "required_lookahead"]


def required_lookahead(method: str, k: int) -> int:
    """Slots past the scheduled tokens that ``method``'s drafter writes (the contract's table,
    kept here independently of the scheduler's own)."""
    if method == "dflash":
        return k + 1
    if method in ("eagle", "eagle3", "mtp", "draft_model"):
        return k
    return 0


class OwnershipCheck:
    """The ownership contract on one step's arrays (numpy, no per-row Python loop)."""

    def __init__(self, config: SoakConfig, lookahead: int) -> None:
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.num_blocks = config.num_blocks
        self.lookahead = lookahead

    def cheap(self, out: Any, n: int) -> List[str]:
        """Row counts cover each query window; owned columns hold valid ids, later columns 0;
        columns that only the lookahead reaches hold blocks no other scheduled row holds."""
        if n == 0:
            return []
        table = out.block_table
        counts = out.num_blocks_per_row.astype(np.int64)
        end_main = out.num_computed_tokens.astype(np.int64) + out.num_scheduled_tokens_array
        end = np.minimum(end_main + self.lookahead, self.max_model_len)
        need = cdiv(end, self.block_size)
        cols = np.arange(table.shape[1])[None, :]
        owned = cols < counts[:, None]
        bad_count = counts < need
        bad_ids = ((table <= 0) | (table >= self.num_blocks)) & owned
        stale = (table != 0) & ~owned
        private = (cols >= (end_main // self.block_size)[:, None]) & (cols < need[:, None])
        valid = owned & ~bad_ids
        holders = np.bincount(table[valid], minlength=self.num_blocks)
        shared = private & valid & (holders[np.where(valid, table, 0)] > 1)
        bad = bad_count | bad_ids.any(1) | stale.any(1) | shared.any(1)
        if not bad.any():
            return []
        return [
            self._describe(out, int(i), need, bad_ids, stale, shared) for i in np.flatnonzero(bad)
        ]

    def _describe(
        self, out: Any, i: int, need: np.ndarray, bad_ids: Any, stale: Any, shared: Any
    ) -> str:
        rid = out.req_ids[i]
        count = int(out.num_blocks_per_row[i])
        if count < need[i]:
            return (
                f"ownership: {rid!r} needs {int(need[i])} blocks for positions up to "
                f"num_computed {int(out.num_computed_tokens[i])} + scheduled "
                f"{int(out.num_scheduled_tokens_array[i])} + lookahead {self.lookahead}, but its "
                f"row has {count}"
            )
        if bad_ids[i].any():
            return (
                f"ownership: {rid!r} row holds an invalid block id: {out.block_table[i].tolist()}"
            )
        if stale[i].any():
            return f"block table: {rid!r} row has stale ids past its count {count}"
        return f"ownership: a lookahead block of {rid!r} is held by another scheduled request"

    @staticmethod
    def full(sched: Scheduler, out: Any, req_ids: List[str]) -> List[str]:
        """``check_invariants()`` and every row against ``block_ids()``."""
        problems = []
        try:
            sched.check_invariants()
        except InvariantError as exc:
            problems.append(f"check_invariants: {exc}")
        table, counts = out.block_table, out.num_blocks_per_row
        for i, rid in enumerate(req_ids):
            row = table[i, : int(counts[i])].tolist()
            if row != sched.block_ids(rid):
                problems.append(f"block table: row of {rid!r} {row} != block_ids")
        return problems
