"""The engine's own record of every request: its tokens and the content tags they imply.

The verifier predicts every KV value from this record alone (never from the scheduler's block
bookkeeping), so the scheduler cannot vouch for itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from dflash_rs.sim.tags import chain_states, content_tags, salt_state

__all__ = ["Ledger", "TrackedRequest"]


@dataclass
class TrackedRequest:
    """One request's committed tokens (prompt + accepted outputs) and their content tags."""

    index: int
    request_id: str
    cache_salt: Optional[str]
    prompt_len: int
    arrival_step: int
    tokens: List[int] = field(default_factory=list)
    resident: bool = False  # holds KV blocks (scheduled and neither preempted nor finished)
    first_scheduled_step: Optional[int] = None
    finish_step: Optional[int] = None
    finish_reason: Optional[str] = None
    num_preemptions: int = 0
    _tags: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64), repr=False)
    _state: int = 0

    def __post_init__(self) -> None:
        self._state = salt_state(self.cache_salt)
        initial = list(self.tokens)
        self.tokens = []
        self._tags = np.empty(max(64, 2 * len(initial)), np.int64)
        self.append(initial)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tags(self) -> np.ndarray:
        """Content tags of positions ``0 .. num_tokens - 1`` (a view)."""
        return self._tags[: len(self.tokens)]

    @property
    def num_output_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    def append(self, tokens: Sequence[int]) -> None:
        """Commit ``tokens`` (accepted outputs) at the end."""
        if not tokens:
            return
        states = chain_states(self._state, tokens)
        n, m = len(self.tokens), len(states)
        if n + m > len(self._tags):
            grown = np.empty(max(2 * len(self._tags), n + m), np.int64)
            grown[:n] = self._tags[:n]
            self._tags = grown
        self._tags[n : n + m] = content_tags(states)
        self.tokens.extend(int(t) for t in tokens)
        self._state = states[-1]

    def speculative_tags(self, drafts: Sequence[int]) -> np.ndarray:
        """Content tags that ``drafts`` would have at positions ``num_tokens ..`` (uncommitted)."""
        return content_tags(chain_states(self._state, drafts))


class Ledger:
    """All requests seen so far, by id; indices are dense and never reused."""

    def __init__(self) -> None:
        self._by_id: Dict[str, TrackedRequest] = {}
        self._by_index: List[TrackedRequest] = []
        self._resident: Dict[str, TrackedRequest] = {}

    def add(
        self, request_id: str, prompt: Sequence[int], cache_salt: Optional[str], step: int
    ) -> TrackedRequest:
        tracked = TrackedRequest(
            index=len(self._by_index),
            request_id=request_id,
            cache_salt=cache_salt,
            prompt_len=len(prompt),
            arrival_step=step,
            tokens=np.asarray(prompt).tolist(),
        )
        self._by_id[request_id] = tracked
        self._by_index.append(tracked)
        return tracked

    def __getitem__(self, request_id: str) -> TrackedRequest:
        return self._by_id[request_id]

    def by_index(self, index: int) -> TrackedRequest:
        return self._by_index[index]

    def __iter__(self) -> Iterator[TrackedRequest]:
        return iter(self._by_index)

    def __len__(self) -> int:
        return len(self._by_index)

    def set_resident(self, tracked: TrackedRequest, resident: bool) -> None:
        """Record that ``tracked`` now holds KV blocks (scheduled) or holds none."""
        tracked.resident = resident
        if resident:
            self._resident[tracked.request_id] = tracked
        else:
            self._resident.pop(tracked.request_id, None)

    def resident(self) -> List[TrackedRequest]:
        """Requests that hold KV blocks now, in admission order."""
        return list(self._resident.values())
