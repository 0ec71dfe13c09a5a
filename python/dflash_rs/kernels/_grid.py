"""Launch geometry of the expansion kernel, shared by its launcher and the output buffers.

Kept free of triton so that ``DFlashInputs.empty`` can size the per-program violation counts
without importing it.
"""

from __future__ import annotations

from dflash_rs._arith import cdiv

__all__ = ["CONTEXT_TILE", "QUERY_TILE", "num_programs"]

# Lanes per program: one lane per thread (4 warps), see dflash_expand.py.
QUERY_TILE = 128
CONTEXT_TILE = 128


def num_programs(query_lanes: int, context_lanes: int) -> int:
    """Programs of one launch over buffers of this capacity (at least one, for empty batches)."""
    return max(1, cdiv(query_lanes, QUERY_TILE) + cdiv(context_lanes, CONTEXT_TILE))
