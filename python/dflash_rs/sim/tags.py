"""The values the stand-in model stores in KV slots, and how the verifier predicts them.

A target or drafter *context* slot at position ``p`` holds ``content_tag``: a hash of the cache
salt and every token at positions ``0..p`` (a polynomial rolling hash modulo the Mersenne prime
``2**61 - 1``, seeded with a hash of the salt). Two requests with the same salt and token prefix
therefore store identical values, so a prefix-cache block written by one request is exactly what
every other request that hits it expects. A drafter *query* slot (DFlash's bonus + mask lanes,
EAGLE's extra positions) holds ``query_tag(request, position, step)``: private to the request
and to the step, so a write by anyone else (or a stale one) never matches.

Content tags lie in ``[0, 2**61)``; query tags have bit 62 set; ``EMPTY`` (-1) marks a slot
never written.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, List, Optional

import numpy as np

__all__ = [
    "EMPTY",
    "QUERY_BIT",
    "chain_states",
    "content_tags",
    "is_query_tag",
    "query_tags",
    "salt_state",
]

EMPTY = -1
QUERY_BIT = 1 << 62
_MASK64 = (1 << 64) - 1
_PRIME = (1 << 61) - 1
_BASE = 0x1E7C5A3F9B2D4861 % _PRIME  # a fixed random base of the rolling hash
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def salt_state(cache_salt: Optional[str]) -> int:
    """The chain state before position 0: a hash of the cache salt (None and "" differ)."""
    data = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") % _PRIME


def chain_states(state: int, tokens: Iterable[int]) -> List[int]:
    """Chain states after each of ``tokens``, starting from ``state`` (the state before them)."""
    states = []
    for token in tokens:
        state = (state * _BASE + int(token) + 1) % _PRIME
        states.append(state)
    return states


def content_tags(states: List[int]) -> np.ndarray:
    """Content tags (int64, in ``[0, 2**61)``) of chain states."""
    return np.array(states, dtype=np.int64)


def _mix64_array(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


def query_tags(owner: np.ndarray, positions: np.ndarray, step: int) -> np.ndarray:
    """Query tags (int64, bit 62 set) for lanes of request indices ``owner`` at ``positions``."""
    z = owner.astype(np.uint64) * np.uint64(_GOLDEN)
    z = _mix64_array(z ^ positions.astype(np.uint64))
    z = _mix64_array(z ^ np.uint64(step & _MASK64))
    return (z >> np.uint64(2)).astype(np.int64) | np.int64(QUERY_BIT)


def is_query_tag(values: np.ndarray) -> np.ndarray:
    """Which of ``values`` are query tags."""
    return (values >= 0) & ((values & np.int64(QUERY_BIT)) != 0)
