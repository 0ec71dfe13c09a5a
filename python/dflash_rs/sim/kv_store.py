"""A real paged KV cache: one torch tensor ``[num_blocks, block_size, num_channels]``.

Channel ``TARGET`` stands for the target model's KV layers and ``DRAFTER`` for the drafter's
(vLLM gives the drafter its own layers in the same paged pool, addressed through the same block
table). Values are tags (see ``tags``). Beside each value the store keeps who wrote it (request
index and position), for violation reports only: the verifier never trusts it.
"""

from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

from dflash_rs.sim.tags import EMPTY

__all__ = ["DRAFTER", "TARGET", "PagedKVStore"]

TARGET = 0
DRAFTER = 1


class PagedKVStore:
    """Tagged KV slots; slot ``s`` is ``kv[s // block_size, s % block_size]``."""

    def __init__(self, num_blocks: int, block_size: int, num_channels: int = 2) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, num_channels)
        self.kv = torch.full(shape, EMPTY, dtype=torch.int64)
        self.writer = torch.full(shape, -1, dtype=torch.int64)
        self.writer_position = torch.full(shape, -1, dtype=torch.int64)
        # numpy views of the same memory: fancy indexing there is much cheaper than in torch.
        self._flat = self.kv.numpy().reshape(-1, num_channels)
        self._flat_writer = self.writer.numpy().reshape(-1, num_channels)
        self._flat_position = self.writer_position.numpy().reshape(-1, num_channels)
        self.num_writes = 0

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def write(
        self,
        channel: int,
        slots: np.ndarray,
        values: np.ndarray,
        writers: np.ndarray,
        positions: np.ndarray,
    ) -> None:
        """Store ``values`` at ``slots`` in lane order (a later lane wins a shared slot);
        negative slots (PAD_SLOT_ID) are skipped, as the attention backends skip them."""
        keep = slots >= 0
        if not keep.all():
            slots, values, writers, positions = (
                a[keep] for a in (slots, values, writers, positions)
            )
        if len(slots) == 0:
            return
        if slots.max() >= self.num_slots:
            raise IndexError(f"slot {int(slots.max())} is outside the KV cache")
        # Last occurrence of each slot, so the result is deterministic: lane order wins.
        _, first_in_reversed = np.unique(slots[::-1], return_index=True)
        last = len(slots) - 1 - first_in_reversed
        index = slots[last]
        self._flat[index, channel] = values[last]
        self._flat_writer[index, channel] = writers[last]
        self._flat_position[index, channel] = positions[last]
        self.num_writes += len(slots)

    def read(self, channel: int, slots: np.ndarray) -> np.ndarray:
        """Values at ``slots`` (all must be valid slots)."""
        return self._flat[slots, channel]

    def provenance(self, channel: int, slot: int) -> Tuple[int, int]:
        """(request index, position) of the last write to ``slot``; (-1, -1) if never written."""
        return int(self._flat_writer[slot, channel]), int(self._flat_position[slot, channel])

    def corrupt(self, channel: int, slot: int, value: int) -> None:
        """Overwrite one slot behind everyone's back (fault injection for tests)."""
        self._flat[slot, channel] = value
        self._flat_writer[slot, channel] = -1
        self._flat_position[slot, channel] = -1
