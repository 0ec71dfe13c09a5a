"""The soak's step loop (``SoakRun``): top up, abort, schedule, check, sample with a fake
model, update, draft; then drain and take the final readings."""

from __future__ import annotations

import time
import tracemalloc
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from dflash_rs import ModelRunnerOutput, Scheduler
from dflash_rs.errors import DFlashRsError
from dflash_rs.soak.config import SoakConfig
from dflash_rs.soak.memory import python_heap, rss_bytes
from dflash_rs.soak.ownership import OwnershipCheck, required_lookahead
from dflash_rs.soak.report import SoakReport, environment
from dflash_rs.soak.workload import EOS_TOKEN_ID, FIRST_TOKEN, RequestSource

__all__ = ["Progress", "SoakRun", "run_soak"]

#: Consecutive empty steps with requests waiting before the run is declared stuck.
_MAX_IDLE_STEPS = 64

Progress = Callable[[int, SoakReport], None]


class SoakRun:
    """The step loop: top up, abort, schedule, check, sample, update, draft."""

    def __init__(self, config: SoakConfig, progress: Optional[Progress] = None) -> None:
        self.config = config
        self.progress = progress
        self.sched = Scheduler(config.scheduler_config())
        self.rng = np.random.default_rng(config.seed)
        self.source = RequestSource(config, np.random.default_rng(config.seed + 1))
        self.lookahead = required_lookahead(config.method, config.k)
        self.check = OwnershipCheck(config, self.lookahead)
        self.report = SoakReport(
            config={**asdict(config), "k": config.k}, environment=environment()
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
            FIRST_TOKEN, self.config.vocab_size, size=int(counts.sum()), dtype=np.int32
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
            report.python_heap_warmup_bytes = python_heap()
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
        report.python_heap_end_bytes = python_heap()
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
