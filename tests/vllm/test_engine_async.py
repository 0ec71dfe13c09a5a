"""The drop-in under vLLM's own async engine loop (``EngineCore.step_with_batch_queue``).

With async scheduling (vLLM's default), ``EngineCore`` keeps ``max_concurrent_batches`` = 2
steps in flight: it schedules step N+1 before it applies step N's output, and never hands the
scheduler drafts (the model runner keeps them; the scheduler schedules placeholders). vLLM picks
``AsyncScheduler`` for this; a custom ``--scheduler-cls`` gets only a warning that a class
without its placeholder semantics loses async scheduling, and is used as is. These tests run
vLLM's engine-loop code itself (an ``EngineCore`` with a fake executor) over ``AsyncScheduler``
and over ``DFlashRsScheduler`` and require the same schedules and outputs, step by step.
"""

from __future__ import annotations

import hashlib
import queue
from collections import deque
from concurrent.futures import Future
from typing import Any, Optional

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import (
    EOS,
    FIRST_TOKEN,
    TraceParams,
    compare_outputs,
    model_runner_env,
    runner_output,
    use_v1_runner,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.core import EngineCore
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

from dflash_rs.vllm import DFlashRsScheduler
from dflash_rs.vllm._compat import installed

OURS = "dflash_rs.vllm.DFlashRsScheduler"


def _done(value: Any) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


class FakeExecutor:
    """The model runner as ``EngineCore`` drives it under async scheduling: ``execute_model``
    then ``sample_tokens``, both returning futures. A request samples when the step reaches the
    end of its prefill tokens (the V2 runner's ``prefill_token_ids``, the V1 runner's prompt or a
    resumed request's ``all_token_ids``); its sampled tokens and how
    many of its own drafts it accepts (the scheduler only saw placeholders) depend only on the
    request id and how often it sampled, so two engines with equal schedules get equal outputs.
    Padded admissions accept none of their placeholder drafts."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.prefill_len: dict[str, int] = {}
        self.num_samples: dict[str, int] = {}
        self.pending: Optional[Any] = None

    def execute_model(self, scheduler_output: Any, non_block: bool = True) -> Future:
        self.seen.append(scheduler_output)
        for r in scheduler_output.scheduled_new_reqs:
            # V2 runner: prefill_token_ids; V1: the prompt (resumed ones come as cached below).
            tokens = r.prompt_token_ids if r.prefill_token_ids is None else r.prefill_token_ids
            self.prefill_len[r.req_id] = len(tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for rid in cached.resumed_req_ids:  # V1: a resumed request with all its tokens
            self.prefill_len[rid] = len(cached.all_token_ids[rid])
        if scheduler_output.total_num_scheduled_tokens == 0:
            return _done(EMPTY_MODEL_RUNNER_OUTPUT)
        self.pending = scheduler_output
        return _done(None)

    def sample_tokens(self, grammar_output: Any, non_block: bool = True) -> Future:
        so, self.pending = self.pending, None
        assert so is not None and grammar_output is None
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        admitted = {r.req_id for r in so.scheduled_new_reqs}
        req_ids = sorted(so.num_scheduled_tokens)
        sampled = [self._sample(so, rid, computed[rid], rid in admitted) for rid in req_ids]
        return _done(runner_output(req_ids, sampled))

    def _sample(self, so: Any, rid: str, computed: int, admitted: bool) -> list[int]:
        if computed + so.num_scheduled_tokens[rid] < self.prefill_len[rid]:
            return []  # a prefill chunk
        i = self.num_samples.get(rid, 0)
        self.num_samples[rid] = i + 1
        h = int.from_bytes(hashlib.sha1(f"{rid}/{i}".encode()).digest()[:8], "little")
        num_drafts = len(so.scheduled_spec_decode_tokens.get(rid, ()))
        accepted = 0 if admitted else h % (num_drafts + 1)
        tokens = [FIRST_TOKEN + (h >> (5 * j)) % 997 for j in range(accepted + 1)]
        if (h >> 50) % 20 == 0:
            tokens[-1] = EOS
        return tokens

    def take_draft_token_ids(self) -> None:
        raise AssertionError("EngineCore asks for drafts only without async scheduling")


def _engine(vllm_config: Any, scheduler: Any, executor: FakeExecutor) -> Any:
    """An ``EngineCore`` without a model: the attributes its batch-queue step reads."""
    engine = object.__new__(EngineCore)
    engine.vllm_config = vllm_config
    engine.log_stats = False
    engine._weight_version = "default"
    engine.model_executor = executor
    engine.scheduler = scheduler
    engine.batch_queue_size = vllm_config.max_concurrent_batches
    engine.batch_queue = deque(maxlen=engine.batch_queue_size)
    engine.is_mm_encoder_only = False
    engine.is_pooling_model = False
    engine.async_scheduling = True
    engine.check_for_draft_tokens = vllm_config.speculative_config is not None
    engine.aborts_queue = queue.Queue()
    return engine


def _norm(outputs: Optional[dict[int, Any]]) -> Any:
    if outputs is None:
        return None
    return {
        client: sorted(
            (o.request_id, list(o.new_token_ids), o.finish_reason, o.stop_reason)
            for o in eco.outputs
        )
        for client, eco in outputs.items()
    }


def _configs(offline: Any, method: str, num_blocks: int, **extra: Any) -> tuple[Any, Any]:
    with model_runner_env(use_v1_runner(False)):
        # EAGLE with vLLM's defaults (lookahead block hashes on 0.33, the last-block drop on 0.32).
        return offline.configs(
            num_blocks=num_blocks,
            method=method,
            num_speculative_tokens=3,
            max_model_len=256,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            async_scheduling=True,
            scheduler={"scheduler_cls": OURS, **extra.pop("scheduler", {})},
            **extra,
        )


def _arrive(offline: Any, rid: str, step: int, engines: Any) -> None:
    """Submits request `rid` arriving at `step` to each (engine, block hasher): 20-109 prompt
    tokens, behind a shared 40-token prefix on odd steps."""
    n = 20 + (step * 37) % 90
    prefix = list(range(1000, 1040)) if step % 2 else []
    prompt = prefix + [2000 + step * 7 + j for j in range(n)]
    for engine, hasher in engines:
        req = offline.request(rid, prompt, 10 + step * 7 % 70, hasher, eos_token_id=EOS)
        engine.scheduler.add_request(req)


def _step_lockstep(p: TraceParams, step: int, ev: Any, ed: Any, vex: Any, dex: Any) -> tuple:
    """Runs one ``step_with_batch_queue`` of vLLM's engine and of ours and checks that they
    executed the same SchedulerOutput (if either executed one) and returned the same outputs.
    Returns vLLM's outputs and whether a new SchedulerOutput was executed."""
    seen = len(vex.seen)
    a, executed_v = ev.step_with_batch_queue()
    b, executed_d = ed.step_with_batch_queue()
    assert len(dex.seen) == len(vex.seen)
    executed_new = len(vex.seen) > seen
    if executed_new:
        compare_outputs(p, step, vex.seen[-1], dex.seen[-1])
    assert (_norm(b), executed_d) == (_norm(a), executed_v), step
    ed.scheduler.core.check_invariants()
    return a, executed_new


def test_vllm_selects_the_drop_in_with_async_scheduling(offline: Any) -> None:
    cfg, _ = _configs(offline, "dflash", 48)
    assert cfg.scheduler_config.async_scheduling
    assert cfg.scheduler_config.get_scheduler_cls() is DFlashRsScheduler
    assert cfg.max_concurrent_batches == 2  # EngineCore keeps two steps in flight


_NGRAM_ASYNC = pytest.param(
    "ngram",
    marks=pytest.mark.skipif(
        installed().name == "0.32",
        reason="vLLM 0.32 refuses async scheduling with the CPU n-gram drafter",
    ),
)


@pytest.mark.parametrize("method", ["none", _NGRAM_ASYNC, "eagle", "dflash"])
def test_engine_async_loop_matches_async_scheduler(offline: Any, method: str) -> None:
    """Requests arrive over time, share a prefix, preempt each other in a small pool and are
    aborted while their steps are in flight; every step's SchedulerOutput and EngineCoreOutputs
    agree with vLLM's AsyncScheduler under the same engine loop."""
    cfg, kv = _configs(offline, method, 24)
    hasher = offline.block_hasher(cfg)
    vex, dex = FakeExecutor(), FakeExecutor()
    ev = _engine(cfg, offline.scheduler(AsyncScheduler, cfg, kv), vex)
    ed = _engine(cfg, offline.scheduler(DFlashRsScheduler, cfg, kv), dex)
    p = TraceParams(seed=0, method=method, async_scheduling=True)
    arrivals = {s: f"r{s}" for s in range(0, 60, 2)}
    aborted: set[str] = set()
    finished: set[str] = set()
    for step in range(400):
        if step in arrivals:
            _arrive(offline, arrivals[step], step, ((ev, hasher), (ed, None)))
        if step in (25, 40, 41, 60) and ev.scheduler.running:
            # A running request, so its latest step is in flight when the abort lands.
            rid = ev.scheduler.running[-1].request_id
            aborted.add(rid)
            for engine in (ev, ed):
                engine.aborts_queue.put([rid])
        if not ev.scheduler.has_requests() and not ev.batch_queue:
            assert not ed.scheduler.has_requests() and not ed.batch_queue
            if step > max(arrivals):
                break
            continue
        a, _ = _step_lockstep(p, step, ev, ed, vex, dex)
        for eco in (a or {}).values():
            finished |= {o.request_id for o in eco.outputs if o.finish_reason is not None}
    assert not ev.scheduler.has_requests() and not ed.scheduler.has_requests()
    assert ed.scheduler.core.get_num_unfinished_requests() == 0
    assert len(finished) > 10
    # The trace preempted requests and aborted some (those are reported only as finished ids).
    assert sum(len(so.preempted_req_ids) for so in vex.seen) > 0
    reported = set().union(*(so.finished_req_ids for so in vex.seen))
    assert len(aborted) == 4 and aborted <= reported - finished


@pytest.mark.parametrize("source", ["local", "dp-throttle"])
def test_engine_prefill_cadence_matches_async_scheduler(offline: Any, source: str) -> None:
    """``prefill_schedule_interval=3`` under the engine loop: vLLM 0.33's local cadence
    (``data_parallel_size`` 1; a no-op on 0.32), or the DP engine core's throttle
    (``DPEngineCoreProc._should_throttle_prefills`` on a step counter the loop advances, as its
    busy loop does). Same schedules and outputs as vLLM's AsyncScheduler, step by step."""
    from vllm.v1.engine.core import DPEngineCoreProc

    parallel = {"data_parallel_size": 2} if source == "dp-throttle" else {}
    cfg, kv = _configs(
        offline,
        "dflash",
        48,
        scheduler={"prefill_schedule_interval": 3},
        parallel=parallel,
    )
    hasher = offline.block_hasher(cfg)
    vex, dex = FakeExecutor(), FakeExecutor()
    ev = _engine(cfg, offline.scheduler(AsyncScheduler, cfg, kv), vex)
    ed = _engine(cfg, offline.scheduler(DFlashRsScheduler, cfg, kv), dex)
    throttled = 0
    if source == "dp-throttle":
        for engine in (ev, ed):
            engine.prefill_schedule_interval = 3
            engine.step_counter = 0
            engine._should_throttle_prefills = DPEngineCoreProc._should_throttle_prefills.__get__(
                engine
            )
    p = TraceParams(seed=0, method="dflash", async_scheduling=True)
    arrivals = {s: f"r{s}" for s in range(0, 60, 3)}
    finished: set[str] = set()
    for step in range(600):
        if step in arrivals:
            _arrive(offline, arrivals[step], step, ((ev, hasher), (ed, None)))
        if not ev.scheduler.has_requests() and not ev.batch_queue:
            assert not ed.scheduler.has_requests() and not ed.batch_queue
            if step > max(arrivals):
                break
            continue
        throttled += source == "dp-throttle" and ev._should_throttle_prefills()
        a, _ = _step_lockstep(p, step, ev, ed, vex, dex)
        for engine in (ev, ed):
            if source == "dp-throttle":
                engine.step_counter += 1
        for eco in (a or {}).values():
            finished |= {o.request_id for o in eco.outputs if o.finish_reason is not None}
    assert not ed.scheduler.has_requests() and len(finished) == len(arrivals)
    assert ed.scheduler.core_config.local_prefill_interval == (
        3 if source == "local" and installed().has_local_prefill_cadence else 1
    )
    assert source == "local" or throttled > 10


class PausingExecutor(FakeExecutor):
    """What ``EngineCore.pause_scheduler`` also calls on the executor (no-ops here)."""

    def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        assert method == "synchronize_device"
        return []

    def reset_mm_cache(self) -> None:
        pass

    def reset_encoder_cache(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["keep", "wait", "abort"])
@pytest.mark.parametrize("method", ["none", "dflash"])
def test_engine_pause_and_resume_match_async_scheduler(
    offline: Any, method: str, mode: str
) -> None:
    """``EngineCore.pause_scheduler(mode, clear_cache=True)`` with steps in flight, then
    ``resume_scheduler()``, twice: "keep" sets PAUSED_ALL and resets the prefix cache preempting
    the running requests (their outputs in flight are dropped); "wait" (``EngineCoreProc``'s:
    PAUSED_NEW, keep stepping until the running requests drain, then reset) and "abort" (abort
    everything, PAUSED_NEW, reset). Requests keep arriving while paused. Every step agrees with
    vLLM's AsyncScheduler under the same loop."""
    cfg, kv = _configs(offline, method, 48)
    hasher = offline.block_hasher(cfg)
    vex, dex = PausingExecutor(), PausingExecutor()
    ev = _engine(cfg, offline.scheduler(AsyncScheduler, cfg, kv), vex)
    ed = _engine(cfg, offline.scheduler(DFlashRsScheduler, cfg, kv), dex)
    for engine in (ev, ed):
        engine.mm_receiver_cache = None
    p = TraceParams(seed=0, method=method, async_scheduling=True)
    arrivals = {s: f"r{s}" for s in range(0, 90, 3)}
    pauses, resumes = {20, 60}, {35, 75}
    draining: set[Any] = set()
    held_back = 0
    for step in range(400):
        if step in arrivals:
            _arrive(offline, arrivals[step], step, ((ev, hasher), (ed, None)))
        if step in pauses:
            assert ev.batch_queue, "a step is in flight when the pause lands"
            for engine in (ev, ed):
                if mode == "wait":  # EngineCoreProc: finished once the engine is idle
                    engine.scheduler.set_pause_state(PauseState.PAUSED_NEW)
                    draining.add(engine)
                else:
                    engine.pause_scheduler(mode=mode, clear_cache=True)
            assert ev.scheduler.get_request_counts() == ed.scheduler.get_request_counts()
            assert ed.scheduler.get_request_counts()[0] == 0 or mode == "wait"
        for engine in [e for e in (ev, ed) if e in draining]:
            if not engine.scheduler.has_requests() and not engine.batch_queue:
                engine._finish_pause(clear_cache=True)
                draining.discard(engine)
        if step in resumes:
            for engine in (ev, ed):
                engine.resume_scheduler()
            draining.clear()
        assert ed.is_scheduler_paused() == ev.is_scheduler_paused()
        if not ev.scheduler.has_requests() and not ev.batch_queue:
            assert not ed.scheduler.has_requests() and not ed.batch_queue
            if step > max(arrivals | dict.fromkeys(resumes)):
                break
            continue
        _, executed_new = _step_lockstep(p, step, ev, ed, vex, dex)
        if executed_new:
            paused_new = ev.scheduler.pause_state == PauseState.PAUSED_NEW
            held_back += paused_new and bool(ev.scheduler.get_request_counts()[1])
    assert not ev.scheduler.has_requests() and not ed.scheduler.has_requests()
    if mode == "keep":  # the resets preempted running requests
        assert set().union(*(so.preempted_req_ids for so in vex.seen))
    if mode == "wait":  # requests queued while the running ones drained
        assert held_back > 0
