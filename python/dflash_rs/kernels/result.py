"""The result type of the DFlash input expansion, and its padding conventions."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Dict, Tuple, Union

import torch

from dflash_rs.kernels._grid import num_programs

__all__ = [
    "BUFFER_DTYPES",
    "BUFFER_NAMES",
    "LANE_BUFFERS",
    "PAD_POSITION",
    "PAD_SLOT_ID",
    "PAD_TOKEN_ID",
    "DFlashInputs",
    "buffer_tensors",
]

PAD_SLOT_ID = -1
"""Slot written for lanes that must not store KV: padding, and strict-mode violations."""
PAD_POSITION = 0
"""Position written for padding lanes: 0 keeps RoPE table lookups in range."""
PAD_TOKEN_ID = 0
"""Input id written for padding query lanes."""

DeviceLike = Union[torch.device, str, int]

#: Field metadata of a buffer of ``DFlashInputs``: its dtype, and for a per-lane buffer what its
#: lanes are (``_QUERY``: K+1 per request, ``_CONTEXT``: one per context token, ``_SAMPLE``: K
#: per request).
_DTYPE, _LANES = "dtype", "lanes"
_QUERY, _CONTEXT, _SAMPLE = "query", "context", "sample"


def _lane_buffer(kind: str, dtype: torch.dtype) -> dict:
    return {_DTYPE: dtype, _LANES: kind}


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

    # int32 [cap_reqs * (K + 1)]
    input_ids: torch.Tensor = dataclasses.field(metadata=_lane_buffer(_QUERY, torch.int32))
    # int64 [cap_reqs * (K + 1)]
    query_positions: torch.Tensor = dataclasses.field(metadata=_lane_buffer(_QUERY, torch.int64))
    # int64 [cap_reqs * (K + 1)]
    query_slot_mapping: torch.Tensor = dataclasses.field(metadata=_lane_buffer(_QUERY, torch.int64))
    # int64 [cap_ctx]
    context_positions: torch.Tensor = dataclasses.field(
        metadata=_lane_buffer(_CONTEXT, torch.int64)
    )
    # int64 [cap_ctx]
    context_slot_mapping: torch.Tensor = dataclasses.field(
        metadata=_lane_buffer(_CONTEXT, torch.int64)
    )
    # int32 [cap_reqs * K]
    token_indices_to_sample: torch.Tensor = dataclasses.field(
        metadata=_lane_buffer(_SAMPLE, torch.int32)
    )
    num_speculative_tokens: int
    # int32 [>= programs of a launch]: program p writes its count of strict-mode violations to
    # slot p (0 in default mode; a launch also zeroes any slot past its grid), so a launch or a
    # CUDA-graph replay needs no memset and no atomics. ``num_violations`` sums it.
    violation_partials: torch.Tensor = dataclasses.field(
        repr=False, compare=False, metadata={_DTYPE: torch.int32}
    )
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
        lanes = _lane_counts(max_num_reqs, max_num_ctx, num_speculative_tokens)
        num_slots = num_programs(lanes[_QUERY], max_num_ctx)
        buffers = {
            f.name: torch.empty(lanes[f.metadata[_LANES]], dtype=f.metadata[_DTYPE], device=device)
            for f in _LANE_FIELDS
        }
        return cls(
            **buffers,
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
        lanes = _lane_counts(num_reqs, num_ctx, self.num_speculative_tokens)
        views = {f.name: getattr(self, f.name)[: lanes[f.metadata[_LANES]]] for f in _LANE_FIELDS}
        return dataclasses.replace(self, **views)


def _lane_counts(num_reqs: int, num_ctx: int, num_speculative_tokens: int) -> Dict[str, int]:
    """Lanes of each kind of per-lane buffer for ``num_reqs`` requests and ``num_ctx`` context
    tokens."""
    return {
        _QUERY: num_reqs * (num_speculative_tokens + 1),
        _CONTEXT: num_ctx,
        _SAMPLE: num_reqs * num_speculative_tokens,
    }


_BUFFER_FIELDS = tuple(f for f in dataclasses.fields(DFlashInputs) if _DTYPE in f.metadata)
_LANE_FIELDS = tuple(f for f in _BUFFER_FIELDS if _LANES in f.metadata)

BUFFER_NAMES: Tuple[str, ...] = tuple(f.name for f in _BUFFER_FIELDS)
"""The tensor fields of ``DFlashInputs``, in the kernel's argument order: the per-lane outputs,
then ``violation_partials``."""
LANE_BUFFERS: Tuple[str, ...] = tuple(f.name for f in _LANE_FIELDS)
"""The per-lane output buffers (query, context and sampling lanes)."""
BUFFER_DTYPES: Dict[str, torch.dtype] = {f.name: f.metadata[_DTYPE] for f in _BUFFER_FIELDS}
"""Each buffer's dtype."""

_get_buffers = operator.attrgetter(*BUFFER_NAMES)


def buffer_tensors(inputs: DFlashInputs) -> Tuple[torch.Tensor, ...]:
    """``inputs``' buffers in ``BUFFER_NAMES`` order."""
    return _get_buffers(inputs)  # type: ignore[no-any-return]
