"""Settings of one simulation run, and the scheduler and workload configs they imply."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict

from dflash_rs.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from dflash_rs.sim.workload import WorkloadConfig

__all__ = ["KERNEL_BACKENDS", "METHODS", "SimConfig"]

METHODS = ("none", *SPECULATIVE_METHODS)
KERNEL_BACKENDS = ("auto", "triton", "reference")


@dataclass(frozen=True)
class SimConfig:
    """One run. The defaults are the README's first command: DFlash K=8 under memory pressure
    (preemptions), shared prefixes, chunked prefill, a few hundred requests."""

    seed: int = 0
    num_requests: int = 3000
    num_blocks: int = 600
    block_size: int = 16
    method: str = "dflash"
    num_speculative_tokens: int = 8
    acceptance_rate: float = 0.8
    arrival_rate: float = 0.0
    max_model_len: int = 4096
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    policy: str = "fcfs"
    kernel: str = "auto"
    lookahead_policy: str = "correct"
    enable_prefix_caching: bool = True
    invariant_check_interval: int = 64
    max_steps: int = 200_000

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.kernel not in KERNEL_BACKENDS:
            raise ValueError(f"kernel must be one of {', '.join(KERNEL_BACKENDS)}")
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError("acceptance_rate must be in [0, 1]")
        if self.max_steps < 1 or self.invariant_check_interval < 0:
            raise ValueError("max_steps must be >= 1 and invariant_check_interval >= 0")
        capacity = (self.num_blocks - 1) * self.block_size
        if capacity < self.max_model_len:
            # As vLLM refuses to start: a request that reaches max_model_len could never fit,
            # not even alone, and would wait forever after a preemption.
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                f"{self.block_size}, one reserved), fewer than max_model_len="
                f"{self.max_model_len}: raise --num-blocks or lower --max-model-len"
            )
        self.scheduler_config()  # validates the rest
        self.workload_config()

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    @property
    def k(self) -> int:
        """Speculative tokens per step (0 without speculation)."""
        return self.num_speculative_tokens if self.speculative else 0

    def scheduler_config(self) -> SchedulerConfig:
        speculative = (
            SpeculativeConfig(self.method, self.num_speculative_tokens)
            if self.speculative
            else None
        )
        return SchedulerConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            policy=self.policy,
            speculative=speculative,
            hash_seed=str(self.seed),
            lookahead_policy=self.lookahead_policy,
        )

    def workload_config(self) -> WorkloadConfig:
        return WorkloadConfig(
            num_requests=self.num_requests,
            seed=self.seed,
            arrival_rate=self.arrival_rate,
            max_model_len=self.max_model_len,
        )

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
