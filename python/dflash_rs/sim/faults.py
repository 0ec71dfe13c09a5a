"""Faults injected on purpose (tests): they prove the verifier fails when KV is aliased."""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from dflash_rs.sim.batch import StepBatch
from dflash_rs.sim.kv_store import TARGET, PagedKVStore

__all__ = ["AliasBlockTable", "Fault", "StrayWrite"]


class Fault:
    """Hooks the engine calls every step; the base class does nothing."""

    fired_at: Optional[int] = None

    def patch_table(self, step: int, out: Any) -> Optional[np.ndarray]:
        """A replacement block table for this step, or None to keep the scheduler's."""
        return None

    def after_model(self, step: int, batch: StepBatch, store: PagedKVStore) -> None:
        """Called after the model's writes, before the verifier reads."""


class AliasBlockTable(Fault):
    """Once, at or after ``step``: point request j's block-table column that holds its first
    scheduled position at request i's first block (a full block of i's context), so j's
    target writes land in i's KV and j reads i's values."""

    def __init__(self, block_size: int, step: int = 0) -> None:
        self.block_size = block_size
        self.step = step

    def patch_table(self, step: int, out: Any) -> Optional[np.ndarray]:
        if self.fired_at is not None or step < self.step:
            return None
        table = np.array(out.block_table, copy=True)
        counts = out.num_blocks_per_row
        computed = out.num_computed_tokens
        ends = computed + out.num_scheduled_tokens_array
        for i in range(table.shape[0]):
            if ends[i] < self.block_size:
                continue
            victim = int(table[i, 0])
            for j in range(table.shape[0]):
                col = int(computed[j]) // self.block_size
                if j == i or victim in table[j, : counts[j]] or col >= counts[j]:
                    continue
                table[j, col] = victim
                self.fired_at = step
                return table
        return None


class StrayWrite(Fault):
    """Once, at or after ``step``: overwrite position 0 of the first scheduled request's
    target KV with a foreign value, behind the model's back."""

    def __init__(self, step: int = 0, value: int = 0x5EED) -> None:
        self.step = step
        self.value = value

    def after_model(self, step: int, batch: StepBatch, store: PagedKVStore) -> None:
        if self.fired_at is not None or step < self.step or batch.num_reqs == 0:
            return
        slot = int(batch.table[0, 0]) * batch.block_size
        store.corrupt(TARGET, slot, self.value)
        self.fired_at = step
