"""The soak's seeded request stream (``RequestSource``) and its token-id range."""

from __future__ import annotations

from typing import Sequence, cast

import numpy as np

from dflash_rs import Request
from dflash_rs.soak.config import SoakConfig

__all__ = ["EOS_TOKEN_ID", "FIRST_TOKEN", "RequestSource"]

EOS_TOKEN_ID = 2
#: The lowest id of a prompt or draft token (below it: the special tokens).
FIRST_TOKEN = 3


class RequestSource:
    """Seeded request stream: a shared prefix (often), a random tail, small ``max_tokens``."""

    def __init__(self, config: SoakConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        low, high = config.shared_prefix_len
        self.prefixes = [
            self.tokens(int(rng.integers(low, high + 1))) for _ in range(config.num_shared_prefixes)
        ]

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(FIRST_TOKEN, self.config.vocab_size, size=n, dtype=np.int32)

    def make(self, index: int) -> Request:
        cfg, rng = self.config, self.rng
        prompt = self.tokens(int(rng.integers(cfg.prompt_len[0], cfg.prompt_len[1] + 1)))
        if self.prefixes and rng.random() < cfg.shared_prefix_prob:
            prefix = self.prefixes[int(rng.integers(len(self.prefixes)))]
            prompt = np.concatenate([prefix, prompt])
        return Request(
            f"q{index}",
            cast(Sequence[int], prompt),  # an int32 array: checked in Rust without a Python loop
            int(rng.integers(cfg.max_tokens[0], cfg.max_tokens[1] + 1)),
            eos_token_id=EOS_TOKEN_ID,
            priority=int(rng.integers(3)),
            arrival_time=float(index),
            cache_salt="tenant-b" if rng.random() < 0.1 else None,
        )
