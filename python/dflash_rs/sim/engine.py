"""The step loop: scheduler -> block table -> kernel -> model writes -> verifier -> sampler ->
``update_from_output`` / drafts, until every request of the workload has finished.

Scheduler time per step is ``schedule()`` + ``update_from_output()`` +
``update_draft_token_ids_from_arrays()``, measured with ``perf_counter_ns``; everything else
(model, verifier, bookkeeping) is the simulation's own cost and is not counted.
"""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import numpy as np
import torch

from dflash_rs import ModelRunnerOutput, Scheduler
from dflash_rs.errors import DFlashRsError, InvariantError
from dflash_rs.sim.batch import SchedulerContractError, StepBatch
from dflash_rs.sim.config import SimConfig
from dflash_rs.sim.faults import Fault
from dflash_rs.sim.kv_store import PagedKVStore
from dflash_rs.sim.ledger import Ledger, TrackedRequest
from dflash_rs.sim.metrics import SimResult, StepSeries
from dflash_rs.sim.model import StandInModel
from dflash_rs.sim.sampler import SampleResult, StandInSampler
from dflash_rs.sim.verifier import Verifier
from dflash_rs.sim.workload import Workload

__all__ = ["Simulation", "SimulationError", "kernel_device", "run_simulation"]

#: Consecutive steps that schedule nothing while requests wait before the run is declared stuck.
MAX_IDLE_STEPS = 64

Progress = Callable[[int, SimResult], None]


class _SchedulerClock:
    """Accumulates wall (``perf_counter_ns``) and thread CPU time over ``with`` blocks (the
    CPU reading also covers the wall-clock reads, about a microsecond)."""

    def __init__(self) -> None:
        self.wall_ns = 0
        self.cpu_ns = 0

    def __enter__(self) -> None:
        self._cpu = time.thread_time_ns()
        self._wall = time.perf_counter_ns()

    def __exit__(self, *exc: object) -> None:
        self.wall_ns += time.perf_counter_ns() - self._wall
        self.cpu_ns += time.thread_time_ns() - self._cpu


class SimulationError(RuntimeError):
    """The run could not go on (stuck scheduler, step limit)."""


def kernel_device(kernel: str) -> str:
    """Where the DFlash kernel's inputs live: CUDA when present and the kernel may use it."""
    if kernel != "reference" and torch.cuda.is_available():
        return "cuda"
    return "cpu"


class Simulation:
    def __init__(self, config: SimConfig, fault: Optional[Fault] = None) -> None:
        self.config = config
        self.fault = fault or Fault()
        self.scheduler = Scheduler(config.scheduler_config())
        self.workload = Workload(config.workload_config())
        self.ledger = Ledger()
        self.store = PagedKVStore(config.num_blocks, config.block_size)
        self.model = StandInModel(
            self.store,
            config.method,
            config.k,
            config.max_model_len,
            kernel_backend=config.kernel,
            device=kernel_device(config.kernel),
        )
        self.sampler = StandInSampler(
            config.acceptance_rate,
            config.k,
            config.workload_config().vocab_size,
            seed=config.seed + 1,
        )
        self.verifier = Verifier(self.store, self.ledger, config.block_size)
        self.result = SimResult(config=config.to_dict(), series=StepSeries())
        self.step = 0
        self.clock = 0
        self._idle_steps = 0

    # -- driver ---------------------------------------------------------------------------

    def run(self, progress: Optional[Progress] = None) -> SimResult:
        # The tensors are tiny: torch worker threads would only compete with the scheduler for
        # the CPU (and distort its timings on a 2-core machine).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        start = time.perf_counter()
        try:
            while self._admit_arrivals():
                finished = self._step()
                if progress is not None:
                    progress(finished, self.result)
            self._check_drained()
        except (SchedulerContractError, SimulationError, DFlashRsError) as exc:
            self.result.error = f"step {self.step}: {type(exc).__name__}: {exc}"
        finally:
            torch.set_num_threads(threads)
        self._finalise(time.perf_counter() - start)
        return self.result

    def _check_invariants(self) -> None:
        """``Scheduler.check_invariants()``; a failure is recorded and the run goes on (the
        legacy lookahead policies break the ownership invariant on purpose)."""
        self.result.invariant_checks += 1
        try:
            self.scheduler.check_invariants()
        except InvariantError as exc:
            self.result.invariant_failures += 1
            if self.result.first_invariant_failure is None:
                self.result.first_invariant_failure = f"step {self.step}: {exc}"

    def _admit_arrivals(self) -> bool:
        """Hand due requests to the scheduler; False once everything has finished."""
        while True:
            for request in self.workload.due(self.clock):
                self.ledger.add(
                    request.request_id, request.prompt_token_ids, request.cache_salt, self.clock
                )
                self.scheduler.add_request(request)
                self.result.requests_submitted += 1
                self.result.prompt_tokens += len(request.prompt_token_ids)
            if self.scheduler.has_unfinished_requests():
                return True
            upcoming = self.workload.next_arrival_step()
            if upcoming is None:
                return False
            self.clock = max(self.clock + 1, upcoming)

    def _step(self) -> int:
        """One model step; returns the number of requests that finished in it."""
        if self.step >= self.config.max_steps:
            raise SimulationError(f"max_steps={self.config.max_steps} reached")
        timer = _SchedulerClock()
        with timer:
            out = self.scheduler.schedule()
        kv_usage = self.scheduler.kv_cache_usage
        batch = self._track_residency(out)
        sample, drafting, violations = self._run_model(batch)
        finished = self._feed_back(out, batch, sample, drafting, timer)

        running, waiting = self.scheduler.get_request_counts()
        num_tokens = int(batch.num_scheduled.sum())
        self.result.series.append(
            timer.wall_ns,
            timer.cpu_ns,
            running,
            waiting,
            batch.num_reqs,
            num_tokens,
            kv_usage,
            violations,
        )
        self.result.computed_tokens += num_tokens
        self.result.draft_tokens_scheduled += sum(len(s) for s in batch.spec_tokens)
        interval = self.config.invariant_check_interval
        if interval and self.step % interval == 0:
            self._check_invariants()
        self.step += 1
        self.clock += 1
        return finished

    def _track_residency(self, out: Any) -> StepBatch:
        """Preempted requests lose their blocks, scheduled ones hold blocks; the result must
        match the scheduler's running set exactly."""
        for rid in out.preempted_req_ids:
            tracked = self.ledger[rid]
            tracked.num_preemptions += 1
            self.ledger.set_resident(tracked, False)
        batch = StepBatch.from_output(
            out, self.ledger, self.step, self.config.block_size, self.fault.patch_table
        )
        for tracked in batch.requests:
            if not tracked.resident:
                if tracked.num_preemptions:
                    self.result.resumed += 1
                if tracked.first_scheduled_step is None:
                    tracked.first_scheduled_step = self.step
                self.ledger.set_resident(tracked, True)
        running = set(self.scheduler.running_request_ids())
        resident = {r.request_id for r in self.ledger.resident()}
        if running != resident:
            raise SchedulerContractError(
                f"step {self.step}: running requests {sorted(running - resident)} were never "
                f"scheduled, {sorted(resident - running)} left without being reported "
                "preempted or finished"
            )
        self._watch_idle(batch)
        return batch

    def _run_model(self, batch: StepBatch) -> tuple[Optional[SampleResult], np.ndarray, int]:
        """Model writes, sampling, drafter writes, verification. Returns the sample, which
        rows propose drafts, and the step's failed checks."""
        drafting = np.zeros(batch.num_reqs, bool)
        if not batch.num_reqs:
            return None, drafting, 0
        target = self.model.forward_target(batch)
        sample = self.sampler.sample(batch)
        drafter = self.model.forward_drafter(batch, sample)
        self.fault.after_model(self.step, batch, self.store)
        violations = self._verify(batch, target, drafter)
        if drafter is not None:
            self.result.ownership_violations += drafter.ownership_violations
            self.result.drafter_skipped_rows += int((~drafter.drafting).sum())
            drafting = drafter.drafting & ~batch.is_prefill_chunk
        elif self.config.speculative:
            drafting = ~batch.is_prefill_chunk
        return sample, drafting, violations

    def _feed_back(
        self,
        out: Any,
        batch: StepBatch,
        sample: Optional[SampleResult],
        drafting: np.ndarray,
        timer: _SchedulerClock,
    ) -> int:
        """``update_from_output`` and new drafts; returns the number of finished requests."""
        tokens = sample.tokens if sample is not None else np.empty(0, np.int32)
        counts = sample.counts if sample is not None else np.empty(0, np.int32)
        runner_output = ModelRunnerOutput.from_arrays(batch.req_ids, tokens, counts)
        with timer:
            outputs = self.scheduler.update_from_output(out, runner_output)
        finished = self._apply_outputs(outputs)
        if self.config.speculative:
            drafting &= np.array([r.finish_reason is None for r in batch.requests], bool)
            draft_tokens, draft_counts = self.sampler.propose(drafting)
            with timer:
                self.scheduler.update_draft_token_ids_from_arrays(out, draft_tokens, draft_counts)
        return finished

    # -- pieces ---------------------------------------------------------------------------

    def _watch_idle(self, batch: StepBatch) -> None:
        self._idle_steps = 0 if batch.num_reqs else self._idle_steps + 1
        if self._idle_steps > MAX_IDLE_STEPS:
            running, waiting = self.scheduler.get_request_counts()
            raise SimulationError(
                f"scheduler scheduled nothing for {MAX_IDLE_STEPS} steps with {running} "
                f"running and {waiting} waiting requests ({self.scheduler.num_free_blocks} "
                "free blocks)"
            )

    def _verify(self, batch: StepBatch, target: Any, drafter: Any) -> int:
        sched = self.scheduler
        owned = [sched.block_ids(rid) for rid in batch.req_ids]
        scheduled = set(batch.req_ids)
        idle: List[TrackedRequest] = [
            r for r in self.ledger.resident() if r.request_id not in scheduled
        ]
        idle_owned = [sched.block_ids(r.request_id) for r in idle]
        idle_computed = [sched.num_computed_tokens(r.request_id) for r in idle]
        return self.verifier.check_step(
            batch, owned, target, drafter, idle, idle_owned, idle_computed
        )

    def _apply_outputs(self, outputs: List[Any]) -> int:
        finished = 0
        for output in outputs:
            tracked = self.ledger[output.request_id]
            tracked.append(output.new_token_ids)
            self.result.generated_tokens += len(output.new_token_ids)
            if output.finished:
                finished += 1
                tracked.finish_step = self.step
                tracked.finish_reason = output.finish_reason
                self.ledger.set_resident(tracked, False)
                reasons = self.result.finish_reasons
                reasons[output.finish_reason] = reasons.get(output.finish_reason, 0) + 1
                self.result.requests_finished += 1
                self.workload.on_finished(tracked.request_id, tracked.tokens, self.clock)
        return finished

    def _check_drained(self) -> None:
        """Once every request has finished, every usable block must be free again."""
        free = self.scheduler.num_free_blocks
        usable = self.config.num_blocks - 1
        if free != usable:
            raise SimulationError(
                f"all requests finished but {usable - free} of {usable} blocks are still held"
            )
        self._check_invariants()

    def _finalise(self, wall_s: float) -> None:
        result = self.result
        result.wall_s = wall_s
        result.sched_s = sum(result.series.sched_ns) / 1e9
        result.scheduler_stats = self.scheduler.stats()
        result.verifier_counts = dict(self.verifier.counts)
        result.integrity_violations = self.verifier.integrity_violations
        result.slots_checked = self.verifier.slots_checked
        result.kv_slots_written = self.store.num_writes
        result.violations = list(self.verifier.records)


def run_simulation(
    config: SimConfig, fault: Optional[Fault] = None, progress: Optional[Progress] = None
) -> SimResult:
    """Run one simulation to completion and return what it measured."""
    return Simulation(config, fault).run(progress)
