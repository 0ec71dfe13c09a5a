"""``dflash-rs soak``: push many requests through the scheduler alone, under memory pressure.

No KV tensor and no kernel: a fake model samples tokens with random draft acceptance, so a
million requests take minutes, not days. Requests have short random prompts (often sharing a
prefix, so the prefix cache hits), small ``max_tokens``, and a few percent are aborted, some
while their step is in flight. The pool is small, so requests are preempted and resumed.

Checked: every step, the block table against the ownership contract with numpy (each row's
query window, lookahead included, lies in its owned columns; no null, stale or foreign ids;
lookahead blocks are private); every ``--check-every`` steps, ``check_invariants()`` and each
row against ``block_ids()``. At the end every request must have finished and been reported
once, and the pool must be whole (no leaked block). RSS is sampled along the way; the run fails
if it grows by ``--max-rss-growth`` percent or more between warm-up and the end.

Exit status: 0 when nothing leaked, nothing was violated and RSS stayed flat; 1 otherwise;
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

import dflash_rs
from dflash_rs import ModelRunnerOutput, Request, Scheduler
from dflash_rs._cli_types import (
    int_at_least,
    non_negative_float,
    output_path,
    positive_int,
    probability,
    seed,
    speculative_tokens,
)
from dflash_rs.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from dflash_rs.errors import DFlashRsError, InvariantError

__all__ = [
    "SoakConfig",
    "SoakReport",
    "add_arguments",
    "check_args",
    "config_from_args",
    "required_lookahead",
    "rss_bytes",
    "run",
    "run_soak",
]

METHODS = ("none", *SPECULATIVE_METHODS)
EOS_TOKEN_ID = 2
_FIRST_TOKEN = 3
#: Consecutive empty steps with requests waiting before the run is declared stuck.
_MAX_IDLE_STEPS = 64
#: Kept violation messages (the count is exact).
_MAX_RECORDS = 20


def required_lookahead(method: str, k: int) -> int:
    """Slots past the scheduled tokens that ``method``'s drafter writes (the contract's table,
    kept here independently of the scheduler's own)."""
    if method == "dflash":
        return k + 1
    if method in ("eagle", "eagle3", "mtp", "draft_model"):
        return k
    return 0


def rss_bytes() -> int:
    """Resident set size of this process (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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


def _python_heap() -> Optional[int]:
    """Bytes traced by tracemalloc (None when it is not tracing)."""
    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None


def _environment() -> Dict[str, Any]:
    return {
        "dflash_rs": dflash_rs.__version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


class _RequestSource:
    """Seeded request stream: a shared prefix (often), a random tail, small ``max_tokens``."""

    def __init__(self, config: SoakConfig, rng: np.random.Generator) -> None:
        self.config = config
        self.rng = rng
        low, high = config.shared_prefix_len
        self.prefixes = [
            self.tokens(int(rng.integers(low, high + 1))) for _ in range(config.num_shared_prefixes)
        ]

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(_FIRST_TOKEN, self.config.vocab_size, size=n, dtype=np.int32)

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


class _OwnershipCheck:
    """The ownership contract on one step's arrays (numpy, no per-row Python loop)."""

    def __init__(self, config: SoakConfig, lookahead: int) -> None:
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.num_blocks = config.num_blocks
        self.lookahead = lookahead

    def cheap(self, out: Any, n: int) -> List[str]:
        """Row counts cover each query window; owned columns hold valid ids, later columns 0;
        columns that only the lookahead reaches hold blocks no other scheduled row holds."""
        if n == 0:
            return []
        table = out.block_table
        counts = out.num_blocks_per_row.astype(np.int64)
        end_main = out.num_computed_tokens.astype(np.int64) + out.num_scheduled_tokens_array
        end = np.minimum(end_main + self.lookahead, self.max_model_len)
        need = -(-end // self.block_size)
        cols = np.arange(table.shape[1])[None, :]
        owned = cols < counts[:, None]
        bad_count = counts < need
        bad_ids = ((table <= 0) | (table >= self.num_blocks)) & owned
        stale = (table != 0) & ~owned
        private = (cols >= (end_main // self.block_size)[:, None]) & (cols < need[:, None])
        valid = owned & ~bad_ids
        holders = np.bincount(table[valid], minlength=self.num_blocks)
        shared = private & valid & (holders[np.where(valid, table, 0)] > 1)
        bad = bad_count | bad_ids.any(1) | stale.any(1) | shared.any(1)
        if not bad.any():
            return []
        return [
            self._describe(out, int(i), need, bad_ids, stale, shared) for i in np.flatnonzero(bad)
        ]

    def _describe(
        self, out: Any, i: int, need: np.ndarray, bad_ids: Any, stale: Any, shared: Any
    ) -> str:
        rid = out.req_ids[i]
        count = int(out.num_blocks_per_row[i])
        if count < need[i]:
            return (
                f"ownership: {rid!r} needs {int(need[i])} blocks for positions up to "
                f"num_computed {int(out.num_computed_tokens[i])} + scheduled "
                f"{int(out.num_scheduled_tokens_array[i])} + lookahead {self.lookahead}, but its "
                f"row has {count}"
            )
        if bad_ids[i].any():
            return (
                f"ownership: {rid!r} row holds an invalid block id: {out.block_table[i].tolist()}"
            )
        if stale[i].any():
            return f"block table: {rid!r} row has stale ids past its count {count}"
        return f"ownership: a lookahead block of {rid!r} is held by another scheduled request"

    @staticmethod
    def full(sched: Scheduler, out: Any, req_ids: List[str]) -> List[str]:
        """``check_invariants()`` and every row against ``block_ids()``."""
        problems = []
        try:
            sched.check_invariants()
        except InvariantError as exc:
            problems.append(f"check_invariants: {exc}")
        table, counts = out.block_table, out.num_blocks_per_row
        for i, rid in enumerate(req_ids):
            row = table[i, : int(counts[i])].tolist()
            if row != sched.block_ids(rid):
                problems.append(f"block table: row of {rid!r} {row} != block_ids")
        return problems


Progress = Callable[[int, "SoakReport"], None]


class SoakRun:
    """The step loop: top up, abort, schedule, check, sample, update, draft."""

    def __init__(self, config: SoakConfig, progress: Optional[Progress] = None) -> None:
        self.config = config
        self.progress = progress
        self.sched = Scheduler(config.scheduler_config())
        self.rng = np.random.default_rng(config.seed)
        self.source = _RequestSource(config, np.random.default_rng(config.seed + 1))
        self.lookahead = required_lookahead(config.method, config.k)
        self.check = _OwnershipCheck(config, self.lookahead)
        self.report = SoakReport(
            config={**asdict(config), "k": config.k}, environment=_environment()
        )
        self.aborts: Dict[int, List[str]] = {}  # step -> ids planned to be aborted then
        self.target_live = 2 * config.max_num_seqs
        self.warmup_at = max(1, int(config.num_requests * config.warmup_fraction))
        self.rss_every = config.rss_every
        self._idle = 0

    def run(self) -> SoakReport:
        report = self.report
        if self.sched.required_lookahead_tokens != self.lookahead:
            report.violate(
                0, f"scheduler requires lookahead {self.sched.required_lookahead_tokens}"
            )
        tracing = self.config.trace_python_heap and not tracemalloc.is_tracing()
        if tracing:
            tracemalloc.start()
        start = time.perf_counter()
        try:
            while report.requests_finished < self.config.num_requests:
                self._step()
            self._drain()
        except (DFlashRsError, RuntimeError) as exc:
            report.error = f"step {report.steps}: {type(exc).__name__}: {exc}"
        report.wall_s = time.perf_counter() - start
        self._finalise()
        if tracing:
            tracemalloc.stop()
        return report

    # -- one step -------------------------------------------------------------------------

    def _step(self) -> None:
        report, sched = self.report, self.sched
        step = report.steps
        self._top_up(step)
        due = self.aborts.pop(step, [])
        in_flight = step % 2 == 1
        if due and not in_flight:
            self._abort(due, None)
        out = sched.schedule()
        req_ids = list(out.req_ids)
        report.finished_ids_reported += len(out.finished_req_ids)
        self._watch_idle(req_ids)
        for problem in self.check.cheap(out, len(req_ids)):
            report.violate(step, problem)
        if step % self.config.check_every == 0:
            report.full_checks += 1
            for problem in self.check.full(sched, out, req_ids):
                report.violate(step, problem)
        if due and in_flight:
            self._abort(due, req_ids)
        tokens, counts = self._sample(out, len(req_ids))
        results = sched.update_from_output(
            out, ModelRunnerOutput.from_arrays(req_ids, tokens, counts)
        )
        finished = self._count_results(results)
        if self.config.method != "none":
            self._propose_drafts(out, len(req_ids))
        report.steps += 1
        if report.steps % self.rss_every == 0:
            self._sample_rss()
        if self.progress is not None:
            self.progress(finished, report)

    def _top_up(self, step: int) -> None:
        report, cfg = self.report, self.config
        live = self.sched.get_num_unfinished_requests()
        while report.requests_submitted < cfg.num_requests and live < self.target_live:
            request = self.source.make(report.requests_submitted)
            self.sched.add_request(request)
            report.requests_submitted += 1
            live += 1
            if self.rng.random() < cfg.abort_rate:
                when = step + int(self.rng.integers(0, 100))
                self.aborts.setdefault(when, []).append(request.request_id)

    def _abort(self, ids: List[str], in_flight: Optional[List[str]]) -> None:
        done = self.sched.finish_requests(ids)
        report = self.report
        report.requests_aborted += len(done)
        report.requests_finished += len(done)
        report.finish_reasons["abort"] = report.finish_reasons.get("abort", 0) + len(done)
        if in_flight and done:
            report.aborted_in_flight += len(set(done) & set(in_flight))

    def _watch_idle(self, req_ids: List[str]) -> None:
        waiting = self.sched.get_num_unfinished_requests()
        self._idle = self._idle + 1 if not req_ids and waiting else 0
        if self._idle > _MAX_IDLE_STEPS:
            raise RuntimeError(f"nothing scheduled for {_MAX_IDLE_STEPS} steps, {waiting} waiting")

    def _sample(self, out: Any, n: int) -> Tuple[np.ndarray, np.ndarray]:
        """Per row: accepted drafts (geometric, capped by the drafts) + 1 bonus token; 0 for
        prefill chunks."""
        if n == 0:
            return np.empty(0, np.int32), np.empty(0, np.int32)
        drafts = out.num_spec_tokens_array.astype(np.int64)
        p = self.config.acceptance_rate
        if p >= 1.0:
            accepted = drafts
        else:
            accepted = np.minimum(self.rng.geometric(1.0 - p, size=n) - 1, drafts)
        counts = np.where(out.is_prefill_chunk, 0, accepted + 1).astype(np.int32)
        self.report.draft_tokens_scheduled += int(drafts.sum())
        tokens = self.rng.integers(
            EOS_TOKEN_ID, self.config.vocab_size, size=int(counts.sum()), dtype=np.int32
        )
        return tokens, counts

    def _propose_drafts(self, out: Any, n: int) -> None:
        counts = self.rng.integers(0, self.config.k + 1, size=n).astype(np.int32)
        counts[np.asarray(out.is_prefill_chunk)] = 0
        tokens = self.rng.integers(
            _FIRST_TOKEN, self.config.vocab_size, size=int(counts.sum()), dtype=np.int32
        )
        self.sched.update_draft_token_ids_from_arrays(out, tokens, counts)

    def _count_results(self, results: List[Any]) -> int:
        report = self.report
        finished = 0
        for r in results:
            report.generated_tokens += len(r.new_token_ids)
            if r.finished:
                finished += 1
                reasons = report.finish_reasons
                reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
        report.requests_finished += finished
        return finished

    def _sample_rss(self) -> None:
        """An RSS sample (and the Python heap at warm-up). The samples are thinned to every
        other one when they reach ``max_rss_samples``, so the list stays small."""
        report = self.report
        rss = rss_bytes()
        report.rss_samples.append((report.requests_finished, rss))
        report.rss_max_bytes = max(report.rss_max_bytes, rss)
        if not report.rss_warmup_bytes and report.requests_finished >= self.warmup_at:
            report.rss_warmup_bytes = rss
            report.python_heap_warmup_bytes = _python_heap()
        if len(report.rss_samples) >= self.config.max_rss_samples:
            report.rss_samples = report.rss_samples[::2]
            self.rss_every *= 2

    # -- the end --------------------------------------------------------------------------

    def _drain(self) -> None:
        """Flush the last finished ids with one empty step, then check the pool is whole."""
        out = self.sched.schedule()
        self.report.finished_ids_reported += len(out.finished_req_ids)
        if out.req_ids:
            raise RuntimeError(f"requests still scheduled after all finished: {out.req_ids}")
        self.sched.update_from_output(out, ModelRunnerOutput([], []))
        for problem in self.check.full(self.sched, out, []):
            self.report.violate(self.report.steps, problem)
        self.report.full_checks += 1

    def _finalise(self) -> None:
        report, sched = self.report, self.sched
        self._sample_rss()
        report.rss_end_bytes = report.rss_samples[-1][1]
        report.python_heap_end_bytes = _python_heap()
        if not report.rss_warmup_bytes:  # too short a run to pass the warm-up point
            report.rss_warmup_bytes = report.rss_samples[0][1]
        report.rss_growth_pct = 100.0 * (report.rss_end_bytes / report.rss_warmup_bytes - 1.0)
        report.usable_blocks = self.config.num_blocks - 1
        report.free_blocks_end = sched.num_free_blocks
        report.kv_usage_end = sched.kv_cache_usage
        held = report.usable_blocks - report.free_blocks_end
        report.leaked_blocks = held if sched.get_num_unfinished_requests() == 0 else 0
        stats = sched.stats()
        report.preemptions = int(stats["num_preemptions"])
        queries = int(stats["prefix_cache_queries"])
        report.prefix_cache_hit_rate = int(stats["prefix_cache_hits"]) / queries if queries else 0
        wall = max(report.wall_s, 1e-9)
        report.requests_per_s = report.requests_finished / wall
        report.steps_per_s = report.steps / wall


def run_soak(config: SoakConfig, progress: Optional[Progress] = None) -> SoakReport:
    """Run one soak to the end and return its report."""
    return SoakRun(config, progress).run()


# -- command line -------------------------------------------------------------------------

_DEFAULTS = SoakConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add(
        "--num-requests", type=positive_int, default=d.num_requests, help="requests to push through"
    )
    add(
        "--num-blocks",
        type=int_at_least(2),
        default=d.num_blocks,
        help="KV blocks (small = preemption)",
    )
    add("--block-size", type=positive_int, default=d.block_size, help="tokens per KV block")
    add(
        "--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="running requests at most"
    )
    add("--method", choices=METHODS, default=d.method, help="speculative method")
    add(
        "-k",
        "--num-speculative-tokens",
        type=speculative_tokens,
        default=d.num_speculative_tokens,
        help="K, drafts per step",
    )
    add("--policy", choices=("fcfs", "priority"), default=d.policy, help="scheduling policy")
    add("--seed", type=seed, default=d.seed, help="workload and sampler seed")
    add(
        "--abort-rate",
        type=probability,
        default=d.abort_rate,
        help="fraction of requests marked to be aborted (if still live by then)",
    )
    add(
        "--check-every",
        type=positive_int,
        default=d.check_every,
        help="full check (check_invariants + block_ids per row) every N steps; the numpy "
        "ownership check runs every step",
    )
    add(
        "--max-rss-growth",
        type=non_negative_float,
        default=d.max_rss_growth_pct,
        help="fail when RSS grows by this many percent from warm-up to the end",
    )
    add(
        "--lookahead-policy",
        choices=("correct", "legacy-first-prefill", "legacy-k"),
        default=d.lookahead_policy,
        help=argparse.SUPPRESS,
    )
    add(
        "--trace-python-heap",
        action="store_true",
        help="also measure the Python heap with tracemalloc (slower), to tell Python from "
        "native growth",
    )
    add("--json", type=output_path, metavar="PATH", help="write the report as JSON")
    add("--quiet", action="store_true", help="no progress bar or summary, only the verdict")


def check_args(args: argparse.Namespace) -> None:
    """Options checked against each other: the run's config must build."""
    config_from_args(args)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        num_requests=args.num_requests,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        method=args.method,
        num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy,
        seed=args.seed,
        abort_rate=args.abort_rate,
        check_every=args.check_every,
        max_rss_growth_pct=args.max_rss_growth,
        lookahead_policy=args.lookahead_policy,
        trace_python_heap=args.trace_python_heap,
    )


def _progress_bar(total: int) -> Tuple[Any, Optional[Progress]]:
    """A tqdm bar when tqdm is installed (the 'sim' extra), else none."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None, None
    bar = tqdm(total=total, unit="req", desc="soak", dynamic_ncols=True)
    seen = [0]

    def update(_: int, report: SoakReport) -> None:
        if report.steps % 200:
            return
        bar.update(report.requests_finished - seen[0])
        seen[0] = report.requests_finished
        rss = report.rss_samples[-1][1] / 2**20 if report.rss_samples else 0.0
        bar.set_postfix(step=report.steps, rss=f"{rss:.0f}MiB", bad=report.violations)

    return bar, update


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # check_args passed
    show_progress = not args.quiet and sys.stderr.isatty()
    bar, progress = _progress_bar(config.num_requests) if show_progress else (None, None)
    try:
        report = run_soak(config, progress)
    finally:
        if bar is not None:
            bar.close()
    text = report.summary()
    print(text if not args.quiet else text.splitlines()[-1])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        if not args.quiet:
            print(f"wrote {args.json}")
    return 0 if report.ok else 1
