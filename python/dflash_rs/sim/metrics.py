"""What a simulation measured: per-step series and end-of-run totals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from dflash_rs.sim.verifier import Violation

__all__ = ["SimResult", "StepSeries"]


@dataclass
class StepSeries:
    """One entry per model step (a call of ``schedule()``)."""

    sched_ns: List[int] = field(default_factory=list)  # schedule + update_from_output + drafts
    sched_cpu_ns: List[int] = field(default_factory=list)  # the same, in thread CPU time
    num_running: List[int] = field(default_factory=list)
    num_waiting: List[int] = field(default_factory=list)
    num_scheduled_reqs: List[int] = field(default_factory=list)
    num_scheduled_tokens: List[int] = field(default_factory=list)
    kv_usage: List[float] = field(default_factory=list)  # right after schedule()
    violations: List[int] = field(default_factory=list)  # failed checks in this step

    def append(
        self,
        sched_ns: int,
        sched_cpu_ns: int,
        running: int,
        waiting: int,
        scheduled_reqs: int,
        scheduled_tokens: int,
        kv_usage: float,
        violations: int,
    ) -> None:
        self.sched_ns.append(sched_ns)
        self.sched_cpu_ns.append(sched_cpu_ns)
        self.num_running.append(running)
        self.num_waiting.append(waiting)
        self.num_scheduled_reqs.append(scheduled_reqs)
        self.num_scheduled_tokens.append(scheduled_tokens)
        self.kv_usage.append(kv_usage)
        self.violations.append(violations)

    def __len__(self) -> int:
        return len(self.sched_ns)


@dataclass
class SimResult:
    """Everything the report needs. ``error`` is set when the run stopped early."""

    config: Dict[str, Any]
    series: StepSeries
    requests_submitted: int = 0
    requests_finished: int = 0
    finish_reasons: Dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    computed_tokens: int = 0
    draft_tokens_scheduled: int = 0
    resumed: int = 0
    drafter_skipped_rows: int = 0
    scheduler_stats: Dict[str, Any] = field(default_factory=dict)
    verifier_counts: Dict[str, int] = field(default_factory=dict)
    integrity_violations: int = 0
    ownership_violations: int = 0
    slots_checked: int = 0
    kv_slots_written: int = 0
    violations: List[Violation] = field(default_factory=list)
    invariant_checks: int = 0
    invariant_failures: int = 0
    first_invariant_failure: Optional[str] = None
    error: Optional[str] = None
    wall_s: float = 0.0
    sched_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.series)

    @property
    def ok(self) -> bool:
        """No violation of any kind and no early stop."""
        other = sum(
            v
            for k, v in self.verifier_counts.items()
            if k in ("table_mismatches", "kernel_mismatches")
        )
        return (
            self.error is None
            and self.integrity_violations == 0
            and self.ownership_violations == 0
            and self.invariant_failures == 0
            and other == 0
        )

    def sched_step_us(self, percentile: float, cpu: bool = False) -> float:
        """Percentile of scheduler time per step in microseconds (wall clock, or thread CPU
        time, which excludes time the OS gave to other processes)."""
        values = self.series.sched_cpu_ns if cpu else self.series.sched_ns
        if not values:
            return 0.0
        return float(np.percentile(np.asarray(values) / 1e3, percentile))

    @property
    def prefix_hit_rate(self) -> float:
        queries = self.scheduler_stats.get("prefix_cache_queries", 0)
        return self.scheduler_stats.get("prefix_cache_hits", 0) / queries if queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        drafts = self.scheduler_stats.get("spec_num_draft_tokens", 0)
        return self.scheduler_stats.get("spec_num_accepted_tokens", 0) / drafts if drafts else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens gained per verification step: accepted drafts + the bonus token."""
        num = self.scheduler_stats.get("spec_num_drafts", 0)
        accepted = self.scheduler_stats.get("spec_num_accepted_tokens", 0)
        return 1.0 + accepted / num if num else 0.0

    @property
    def preemptions(self) -> int:
        return int(self.scheduler_stats.get("num_preemptions", 0))

    @property
    def kv_usage_max(self) -> float:
        return max(self.series.kv_usage, default=0.0)

    @property
    def kv_usage_mean(self) -> float:
        return float(np.mean(self.series.kv_usage)) if self.series.kv_usage else 0.0
