"""Stand-in sampler: verifies drafts with a configurable acceptance rate and proposes new ones.

Acceptance follows speculative decoding's prefix rule: draft ``j`` is accepted with probability
``acceptance_rate`` provided drafts ``0 .. j-1`` were, and the first rejection ends the run. The
sampled tokens are the accepted drafts plus one bonus token (an EOS with small probability).
Prefill chunks sample nothing; the drafter still runs on them with the next prompt token as its
anchor (vLLM's "backup token"), and the scheduler discards their drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import numpy as np

from dflash_rs.sim.batch import StepBatch
from dflash_rs.sim.workload import EOS_TOKEN_ID, FIRST_TEXT_TOKEN

__all__ = ["SampleResult", "StandInSampler"]


@dataclass
class SampleResult:
    """Per row: sampled tokens (flat, with counts), rejected drafts and the drafter's anchor."""

    tokens: np.ndarray  # int32 [sum(counts)]
    counts: np.ndarray  # int32 [n]
    num_rejected: np.ndarray  # int32 [n]
    anchor_tokens: np.ndarray  # int32 [n]: bonus token, or the next prompt token for chunks


class StandInSampler:
    def __init__(
        self,
        acceptance_rate: float,
        num_speculative_tokens: int,
        vocab_size: int,
        seed: int,
        eos_prob: float = 0.002,
    ) -> None:
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        self.acceptance_rate = acceptance_rate
        self.k = num_speculative_tokens
        self.vocab_size = vocab_size
        self.eos_prob = eos_prob
        self._rng = np.random.default_rng(seed)

    def _text_tokens(self, n: int) -> np.ndarray:
        return self._rng.integers(FIRST_TEXT_TOKEN, self.vocab_size, size=n, dtype=np.int32)

    def sample(self, batch: StepBatch) -> SampleResult:
        n = batch.num_reqs
        num_drafts = np.array([len(s) for s in batch.spec_tokens], np.int64)
        # Accepted drafts: the length of the leading run of successes, at most num_drafts.
        width = max(int(num_drafts.max(initial=0)), 1)
        hits = self._rng.random((n, width)) < self.acceptance_rate
        hits &= np.arange(width)[None, :] < num_drafts[:, None]
        accepted = np.cumprod(hits, axis=1).sum(axis=1)
        bonus = self._text_tokens(n)
        bonus[self._rng.random(n) < self.eos_prob] = EOS_TOKEN_ID
        chunk = batch.is_prefill_chunk
        tokens: List[int] = []
        anchors = bonus.copy()
        for i in range(n):
            if chunk[i]:
                anchors[i] = batch.requests[i].tokens[int(batch.end[i])]
            else:
                tokens.extend(batch.spec_tokens[i][: accepted[i]])
                tokens.append(int(bonus[i]))
        counts = np.where(chunk, 0, accepted + 1).astype(np.int32)
        rejected = np.where(chunk, 0, num_drafts - accepted).astype(np.int32)
        return SampleResult(np.array(tokens, np.int32), counts, rejected, anchors)

    def propose(self, drafting: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """K new drafts for every row where ``drafting`` is true: (flat int32, counts int32)."""
        counts = np.where(drafting, self.k, 0).astype(np.int32)
        return self._text_tokens(int(counts.sum())), counts
