"""The result type of the DFlash input expansion, and its padding conventions."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union

import torch

from dflash_rs.kernels._grid import num_programs

__all__ = ["PAD_POSITION", "PAD_SLOT_ID", "PAD_TOKEN_ID", "DFlashInputs"]

PAD_SLOT_ID = -1
"""Slot written for lanes that must not store KV: padding, and strict-mode violations."""
PAD_POSITION = 0
"""Position written for padding lanes: 0 keeps RoPE table lookups in range."""
PAD_TOKEN_ID = 0
"""Input id written for padding query lanes."""

DeviceLike = Union[torch.device, str, int]


@dataclass(frozen=True)
class DFlashInputs:
    """Buffers the DFlash first pass reads; one instance can be reused across steps.

    Query buffers hold ``num_reqs * (K + 1)`` real lanes (request ``r`` owns lanes
    ``r*(K+1) .. r*(K+1)+K``: the bonus token, then ``K`` mask tokens); context buffers hold one
    lane per context token. When the buffers are larger than the batch (``out=`` for a CUDA
    graph), every lane past the batch is padding: input id ``PAD_TOKEN_ID``, position
    ``PAD_POSITION``, slot ``PAD_SLOT_ID``. ``token_indices_to_sample`` is structural and filled
    over its whole capacity (entry ``r*K + q - 1`` is ``r*(K+1) + q``), so padded requests sample
    from their own (padding) lanes.
    """

    input_ids: torch.Tensor  # int32 [cap_reqs * (K + 1)]
    query_positions: torch.Tensor  # int64 [cap_reqs * (K + 1)]
    query_slot_mapping: torch.Tensor  # int64 [cap_reqs * (K + 1)]
    context_positions: torch.Tensor  # int64 [cap_ctx]
    context_slot_mapping: torch.Tensor  # int64 [cap_ctx]
    token_indices_to_sample: torch.Tensor  # int32 [cap_reqs * K]
    num_speculative_tokens: int
    # int32 [>= programs of a launch]: program p writes its count of strict-mode violations to
    # slot p (0 in default mode; a launch also zeroes any slot past its grid), so a launch or a
    # CUDA-graph replay needs no memset and no atomics. ``num_violations`` sums it.
    violation_partials: torch.Tensor = dataclasses.field(repr=False, compare=False)
    # Launch plans of eager calls into these buffers, keyed by everything the argument checks and
    # the kernel's specialisation read (see kernels/_launch_cache.py). Not copied by ``narrow``
    # or ``dataclasses.replace``: a new buffer set starts with none.
    _launch_plans: dict = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @classmethod
    def empty(
        cls,
        max_num_reqs: int,
        max_num_ctx: int,
        num_speculative_tokens: int,
        device: DeviceLike = "cpu",
    ) -> DFlashInputs:
        """Allocate buffers for up to ``max_num_reqs`` requests and ``max_num_ctx`` context tokens.

        Contents are uninitialised except the per-program violation counts (zeros).
        """
        num_query = max_num_reqs * (num_speculative_tokens + 1)
        num_slots = num_programs(num_query, max_num_ctx)

        def alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(n, dtype=dtype, device=device)

        return cls(
            input_ids=alloc(num_query, torch.int32),
            query_positions=alloc(num_query, torch.int64),
            query_slot_mapping=alloc(num_query, torch.int64),
            context_positions=alloc(max_num_ctx, torch.int64),
            context_slot_mapping=alloc(max_num_ctx, torch.int64),
            token_indices_to_sample=alloc(max_num_reqs * num_speculative_tokens, torch.int32),
            num_speculative_tokens=num_speculative_tokens,
            violation_partials=torch.zeros(num_slots, dtype=torch.int32, device=device),
        )

    @property
    def num_violations(self) -> torch.Tensor:
        """int32 [1]: strict-mode lanes mapped to ``PAD_SLOT_ID`` by the last launch into these
        buffers (0 after a default-mode launch), or, with ``accumulate_violations=True``, by every
        launch since :meth:`reset_violations`.

        Computed when read (a torch sum over ``violation_partials``, on their device), so it
        reflects the latest launch or CUDA-graph replay; it is a new tensor on every read, and
        writing to it changes nothing.
        """
        return self.violation_partials.sum(dtype=torch.int32).reshape(1)

    def reset_violations(self) -> None:
        """Zero the violation counts (what an accumulating caller does after reading them)."""
        self.violation_partials.zero_()

    @property
    def max_num_reqs(self) -> int:
        """Request capacity of the query buffers."""
        return self.input_ids.numel() // (self.num_speculative_tokens + 1)

    @property
    def max_num_ctx(self) -> int:
        """Context-token capacity of the context buffers."""
        return self.context_positions.numel()

    def narrow(self, num_reqs: int, num_ctx: int) -> DFlashInputs:
        """Views of the first ``num_reqs`` requests' query lanes and ``num_ctx`` context lanes."""
        num_query = num_reqs * (self.num_speculative_tokens + 1)
        return dataclasses.replace(
            self,
            input_ids=self.input_ids[:num_query],
            query_positions=self.query_positions[:num_query],
            query_slot_mapping=self.query_slot_mapping[:num_query],
            context_positions=self.context_positions[:num_ctx],
            context_slot_mapping=self.context_slot_mapping[:num_ctx],
            token_indices_to_sample=self.token_indices_to_sample[
                : num_reqs * self.num_speculative_tokens
            ],
        )
