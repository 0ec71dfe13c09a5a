"""The settings of one soak run (``SoakConfig``) and the scheduler config they build."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from dflash_rs.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig

__all__ = ["METHODS", "SoakConfig"]

METHODS = ("none", *SPECULATIVE_METHODS)


@dataclass(frozen=True)
class SoakConfig:
    """One soak run. The defaults allow 64 running requests (128 live) on a pool of 63 usable
    blocks of 16 tokens, so preemption is frequent."""

    num_requests: int = 1_000_000
    num_blocks: int = 64
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    method: str = "dflash"
    num_speculative_tokens: int = 4
    acceptance_rate: float = 0.7
    abort_rate: float = 0.03
    seed: int = 0
    check_every: int = 100
    policy: str = "fcfs"
    lookahead_policy: str = "correct"
    prompt_len: Tuple[int, int] = (4, 64)
    max_tokens: Tuple[int, int] = (1, 24)
    num_shared_prefixes: int = 8
    shared_prefix_len: Tuple[int, int] = (16, 96)
    shared_prefix_prob: float = 0.7
    vocab_size: int = 1000
    warmup_fraction: float = 0.1
    rss_every: int = 500
    max_rss_samples: int = 256
    max_rss_growth_pct: float = 5.0
    trace_python_heap: bool = False

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.check_every < 1 or self.rss_every < 1:
            raise ValueError("num_requests, check_every and rss_every must be >= 1")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for name in ("acceptance_rate", "abort_rate", "shared_prefix_prob", "warmup_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")
        longest = self.shared_prefix_len[1] + self.prompt_len[1]
        if longest > self.max_model_len:
            raise ValueError(f"prompts of up to {longest} tokens exceed max_model_len")
        if (self.num_blocks - 1) * self.block_size < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} blocks of {self.block_size} cannot hold one request of "
                f"max_model_len={self.max_model_len}: raise --num-blocks"
            )
        self.scheduler_config()  # validates the rest

    @property
    def k(self) -> int:
        return 0 if self.method == "none" else self.num_speculative_tokens

    def scheduler_config(self) -> SchedulerConfig:
        spec = None if self.method == "none" else SpeculativeConfig(self.method, self.k)
        return SchedulerConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy=self.policy,
            speculative=spec,
            hash_algo="xxh3_128",
            lookahead_policy=self.lookahead_policy,
        )
