"""What one soak run measured (``SoakReport``), its verdict, its text summary and the machine
it ran on."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import dflash_rs

__all__ = ["SoakReport", "environment"]

#: Kept violation messages (the count is exact).
_MAX_RECORDS = 20


@dataclass
class SoakReport:
    """What one soak run measured. ``ok``: no leak, no violation, every request accounted for,
    RSS growth below the limit."""

    config: Dict[str, Any]
    environment: Dict[str, Any]
    steps: int = 0
    requests_submitted: int = 0
    requests_finished: int = 0  # by any reason, aborts included
    requests_aborted: int = 0
    aborted_in_flight: int = 0
    finish_reasons: Dict[str, int] = field(default_factory=dict)
    finished_ids_reported: int = 0
    wall_s: float = 0.0
    requests_per_s: float = 0.0
    steps_per_s: float = 0.0
    preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    generated_tokens: int = 0
    draft_tokens_scheduled: int = 0
    full_checks: int = 0
    violations: int = 0
    violation_records: List[str] = field(default_factory=list)
    rss_warmup_bytes: int = 0
    rss_end_bytes: int = 0
    rss_max_bytes: int = 0
    rss_growth_pct: float = 0.0
    rss_samples: List[Tuple[int, int]] = field(default_factory=list)  # (finished, bytes)
    #: Python heap (tracemalloc) at warm-up and at the end, with ``trace_python_heap`` only.
    python_heap_warmup_bytes: Optional[int] = None
    python_heap_end_bytes: Optional[int] = None
    free_blocks_end: int = 0
    usable_blocks: int = 0
    leaked_blocks: int = 0
    kv_usage_end: float = 0.0
    error: Optional[str] = None

    @property
    def accounted(self) -> bool:
        n = self.config["num_requests"]
        return (
            self.requests_submitted == self.requests_finished == n == (self.finished_ids_reported)
        )

    @property
    def ok(self) -> bool:
        return (
            self.error is None
            and self.violations == 0
            and self.leaked_blocks == 0
            and self.accounted
            and self.rss_growth_pct < self.config["max_rss_growth_pct"]
        )

    def _heap_summary(self) -> str:
        if self.python_heap_warmup_bytes is None or self.python_heap_end_bytes is None:
            return ""
        kib = 1 / 2**10
        return (
            f"; Python heap {self.python_heap_warmup_bytes * kib:,.0f} -> "
            f"{self.python_heap_end_bytes * kib:,.0f} KiB"
        )

    def violate(self, step: int, message: str) -> None:
        self.violations += 1
        if len(self.violation_records) < _MAX_RECORDS:
            self.violation_records.append(f"step {step}: {message}")

    def to_dict(self) -> Dict[str, Any]:
        return {"ok": self.ok, **asdict(self)}

    def summary(self) -> str:
        mib = 1 / 2**20
        cfg = self.config
        method = cfg["method"] if cfg["method"] == "none" else f"{cfg['method']} K={cfg['k']}"
        lines = [
            f"dflash-rs soak: {method}, {cfg['num_blocks']} blocks of {cfg['block_size']}, "
            f"max_num_seqs {cfg['max_num_seqs']}, policy {cfg['policy']}, lookahead policy "
            f"{cfg['lookahead_policy']}, seed {cfg['seed']}",
            f"  requests   {self.requests_finished:,} finished of {self.requests_submitted:,} "
            f"submitted ({_reasons(self.finish_reasons)}; {self.aborted_in_flight:,} aborted "
            f"in flight); {self.finished_ids_reported:,} finished ids reported",
            f"  steps      {self.steps:,} in {self.wall_s:.1f} s: {self.requests_per_s:,.0f} "
            f"requests/s, {self.steps_per_s:,.0f} steps/s",
            f"  pressure   {self.preemptions:,} preemptions, prefix-cache hit rate "
            f"{self.prefix_cache_hit_rate:.1%}, {self.draft_tokens_scheduled:,} drafts scheduled",
            f"  memory     RSS {self.rss_warmup_bytes * mib:.1f} MiB after warm-up, "
            f"{self.rss_end_bytes * mib:.1f} MiB at the end ({self.rss_growth_pct:+.2f}%), "
            f"max {self.rss_max_bytes * mib:.1f} MiB{self._heap_summary()}",
            f"  blocks     {self.leaked_blocks} leaked ({self.free_blocks_end} of "
            f"{self.usable_blocks} free at the end, usage {self.kv_usage_end:.1%})",
            f"  integrity  {self.violations} violations ({self.full_checks:,} full checks)",
            *(f"    {r}" for r in self.violation_records[:5]),
        ]
        if self.error:
            lines.append(f"  error      {self.error}")
        lines.append(_verdict(self))
        return "\n".join(lines)


def _reasons(reasons: Dict[str, int]) -> str:
    return ", ".join(f"{n:,} {r}" for r, n in sorted(reasons.items())) or "none"


def _verdict(report: SoakReport) -> str:
    if report.ok:
        return "OK: no leak, no violation, RSS flat"
    why = []
    if report.error:
        why.append("the run stopped early")
    if report.violations:
        why.append(f"{report.violations} violations")
    if report.leaked_blocks:
        why.append(f"{report.leaked_blocks} leaked blocks")
    if not report.accounted:
        why.append("requests not accounted for")
    if report.rss_growth_pct >= report.config["max_rss_growth_pct"]:
        why.append(f"RSS grew {report.rss_growth_pct:.1f}%")
    return "FAILED: " + ", ".join(why)


def environment() -> Dict[str, Any]:
    """Versions and machine, recorded in the report."""
    return {
        "dflash_rs": dflash_rs.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
