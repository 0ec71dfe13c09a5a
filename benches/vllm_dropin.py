#!/usr/bin/env python3
"""Engine-side per-step cost: vLLM 0.33's default ``Scheduler`` vs ``DFlashRsScheduler``.

Both run inside vLLM's own objects, in the same process (the vLLM venv): vLLM ``Request``s in,
vLLM ``SchedulerOutput`` and ``EngineCoreOutputs`` out, drafts as ``DraftTokenIds``. A step is
what EngineCore's synchronous ``step()`` + ``post_step()`` ask of the scheduler:

    so = sched.schedule(); sched.get_grammar_bitmask(so)          # timed
    mro = <fabricated ModelRunnerOutput>                           # not timed
    sched.update_from_output(so, mro)                              # timed
    sched.update_draft_token_ids(DraftTokenIds(...))               # timed

Workloads (``--modes``), those of ``dflash-rs bench`` (python/dflash_rs/bench): prompts of
128..2048 tokens (even ids share a 512-token prefix), DFlash with K drafts, uniform 0..K accepted
plus a bonus token, K random drafts for every request that sampled.

- ``decode``: N requests admitted at once, max_tokens 2048 so none finishes in the window; every
  measured step schedules all N.
- ``serve``: a closed loop of N requests with max_tokens drawn from 1..``--serve-max-tokens``
  (256); each finished request is replaced by a new one (``add_request``, timed apart as
  ``admit``), so steps mix chunked prefills, decodes, finishes and admissions.

The fabricated runner output lists requests in the order of ``so.num_scheduled_tokens``
(``--runner-order shuffled`` shuffles it instead). Measured: 150 steps after every initial
request finished its prefill plus 20 warm-up steps; CPU time of this thread
(``time.thread_time_ns``). Reps are interleaved (vLLM, ours, ours, vLLM, ...) and each cell is
the median over reps of the per-rep p50. The heap is frozen after setup and the collector stays
on, as in EngineCore; ``--gc-stats`` also reports the mean CPU time and number of its runs that
fall inside the timed phases, per step.

Object lifetimes (``--lifetimes``), the same on both sides:

- ``engine`` (the default) frees each step's ``SchedulerOutput``, runner output,
  ``EngineCoreOutputs`` and ``DraftTokenIds`` after the step, untimed, where vLLM's EngineCore
  frees them: ``step()`` holds the ``SchedulerOutput`` and the runner output in locals that die
  when it returns, ``post_step()`` the drafts, and the ``EngineCoreOutputs`` go to the output
  thread, which serialises and drops them. None of that runs inside a scheduler call. What the
  scheduler itself frees (a finished request's vLLM ``Request``) stays timed.
- ``phases``: the phase that replaces an object pays for freeing it (``so = schedule()`` frees
  the previous step's ``SchedulerOutput``, and so on): a stricter accounting that charges both
  schedulers for work no engine does inside them.

Finished requests (``--finished-requests``): vLLM's engine hands each ``Request`` to the
scheduler, which then holds its only reference, so the scheduler that drops a finished request
frees it (its prompt's int objects, token lists, block hashes): about 12 µs for a 1,088-token
prompt here, on either side, and a serve step finishes several. ``kept`` moves that common part
out of the timed calls on both sides, to show what the rest costs; ``freed`` is the engine.

Caches (``--evict-kib``): by default the timed calls run back to back, so each finds the
previous one's data in the CPU caches. In an engine the model's forward runs between them and
evicts the core's per-core caches; ``--evict-kib 8192`` writes every line of an 8 MiB buffer,
untimed, before each step's ``schedule()`` and before the runner builds its output (a forward
ends with the runner's output, which is then warm), on both sides.

Run (from the repository root; builds/uses .venv-vllm):

    scripts/vllm_env.sh python benches/vllm_dropin.py --n 256,1024 --reps 3 --markdown
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

import numpy as np

PHASES = ("schedule", "update", "drafts", "total", "admit")

#: Called with True just before each timed phase of a measured step starts and with False just
#: after it ends, outside the clock reads (``benches/callgrind_dropin.py`` counts instructions
#: inside the phases with it); None: nothing is called.
PHASE_HOOK: Optional[Callable[[bool], None]] = None


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="256,1024", help="running requests N (comma list)")
    p.add_argument("--modes", default="decode", help="decode and/or serve (comma list)")
    p.add_argument("--serve-max-tokens", type=int, default=256, help="serve: max_tokens 1..this")
    p.add_argument("-k", type=int, default=8, help="DFlash K (0: no speculation)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--measure-steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--runner-order", choices=["scheduler", "shuffled"], default="scheduler")
    p.add_argument("--sides", default="vllm,dflash-rs")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    p.add_argument(
        "--lifetimes",
        choices=["engine", "phases"],
        default="engine",
        help="engine: the step's SchedulerOutput, runner output, EngineCoreOutputs and drafts "
        "are freed untimed after the step, as vLLM's EngineCore frees them; phases: the phase "
        "that replaces each object pays for freeing it",
    )
    p.add_argument(
        "--finished-requests",
        choices=["freed", "kept"],
        default="freed",
        help="freed: a finished request's vLLM Request is freed where the scheduler drops it, "
        "inside the timed call, as in an engine; kept: the bench holds every Request until "
        "the step after it finished and frees it untimed, on both sides (a diagnostic: what "
        "the schedulers cost without that common part)",
    )
    p.add_argument(
        "--evict-kib",
        type=int,
        default=0,
        help="before each step's schedule and before the runner's output, untimed, sweep a "
        "buffer of this many KiB (a write to every cache line), as the model's forward does to "
        "the CPU caches in an engine; 0: none (the calls run back to back, caches warm)",
    )
    p.add_argument(
        "--gc-stats",
        action="store_true",
        help="also time the cyclic collector's runs inside the timed phases (gc.callbacks)",
    )
    return p.parse_args(argv)


class GcClock:
    """CPU time and number of the cyclic collector's runs, summed (``gc.callbacks``); stays at
    zero unless installed."""

    def __init__(self) -> None:
        self.ns = 0
        self.runs = 0
        self._start = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.thread_time_ns()
        else:
            self.ns += time.thread_time_ns() - self._start
            self.runs += 1


class Runner:
    """What a model runner knows: per request, known tokens and computed tokens; fabricates
    sampled tokens and drafts from a seeded generator."""

    def __init__(self, k: int, seed: int) -> None:
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

        self.k = k
        self.rng = np.random.default_rng(seed)
        self.num_tokens: dict[str, int] = {}
        self.MRO, self.Drafts = ModelRunnerOutput, DraftTokenIds

    def add(self, rid: str, prompt_len: int) -> None:
        self.num_tokens[rid] = prompt_len

    def output(self, so: Any, shuffle: bool) -> tuple[Any, list[str], int]:
        computed = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        c = so.scheduled_cached_reqs
        computed.update(zip(c.req_ids, c.num_computed_tokens))
        ids = list(so.num_scheduled_tokens)
        if shuffle:
            self.rng.shuffle(ids)
        m = len(ids)
        bonus = self.rng.integers(3, 32000, m).tolist()
        accept = self.rng.integers(0, self.k + 1, m).tolist()
        spec = so.scheduled_spec_decode_tokens
        sampled, live, prefill = [], [], 0
        for i, rid in enumerate(ids):
            if computed[rid] + so.num_scheduled_tokens[rid] < self.num_tokens[rid]:
                sampled.append([])
                prefill += 1
                continue
            drafts = spec.get(rid, ())
            sampled.append([*drafts[: accept[i]], bonus[i]])
            live.append(rid)
        mro = self.MRO(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        return mro, live, prefill

    def consume(self, outputs: dict[int, Any]) -> int:
        finished = 0
        for eco in outputs.values():
            for o in eco.outputs:
                self.num_tokens[o.request_id] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    finished += 1
                    del self.num_tokens[o.request_id]
        return finished

    def drafts(self, live: list[str]) -> Any:
        tokens = self.rng.integers(3, 32000, (len(live), self.k)).tolist()
        return self.Drafts(req_ids=live, draft_token_ids=tokens)


def run_one(
    offline: Any, side: str, mode: str, n: int, a: argparse.Namespace, rep: int
) -> dict[str, Any]:
    from vllm.v1.core.sched.scheduler import Scheduler

    from dflash_rs.bench.workload import Workload
    from dflash_rs.vllm import DFlashRsScheduler

    cls = Scheduler if side == "vllm" else DFlashRsScheduler
    serve = mode == "serve"
    max_tokens = a.serve_max_tokens if serve else a.max_tokens
    per_req = math.ceil((a.max_prompt + max_tokens + a.k + 2) / a.block_size) + 1
    cfg, kv = offline.configs(
        num_blocks=n * per_req + 1,
        method="dflash" if a.k else "none",
        num_speculative_tokens=a.k,
        block_size=a.block_size,
        max_model_len=a.max_model_len,
        max_num_seqs=max(n, 256),
        max_num_batched_tokens=a.max_num_batched_tokens,
    )
    sched = offline.scheduler(cls, cfg, kv, log_stats=True)
    hasher = offline.block_hasher(cfg)
    seed = a.seed + 1000 * n + rep
    wl = Workload(SimpleNamespace(**vars(a)), seed)
    runner = Runner(a.k, seed + 7919)
    draw = np.random.default_rng(seed + 104729)

    def admit() -> int:
        """Admits the next request; returns the CPU time of add_request."""
        rid, prompt = wl.next(as_array=False)
        mt = int(draw.integers(1, max_tokens + 1)) if serve else max_tokens
        req = offline.request(rid, prompt, mt, hasher)
        runner.add(rid, len(prompt))
        if a.finished_requests == "kept":
            kept.append(req)
        t = now()
        sched.add_request(req)
        return now() - t

    now = time.thread_time_ns
    kept: list[Any] = []  # --finished-requests kept: every live request, also held here
    sweep = np.zeros(a.evict_kib * 1024 // 8, dtype=np.int64)

    def evict() -> None:
        """Stands for the model's forward (--evict-kib): the previous step's forward before
        schedule(), this step's before the runner builds its output."""
        if sweep.size:
            sweep[::8] += 1  # one write per 64-byte line

    initial = set()
    for _ in range(n):
        admit()
        initial.add(f"r{wl.counter - 1}")
    times: dict[str, list[int]] = {ph: [] for ph in PHASES}
    gc_ns: list[int] = []
    gc_runs: list[int] = []
    state, warm, steps, scheduled = "fill", a.warmup_steps, 0, []
    clock = GcClock()
    gc.collect()
    gc.freeze()
    if a.gc_stats:
        gc.callbacks.append(clock)
    try:
        while len(times["total"]) < a.measure_steps:
            steps += 1
            if steps > 20000:
                raise RuntimeError("no steady decode state reached")
            hook = PHASE_HOOK if state == "measure" else None
            evict()
            g0 = (clock.ns, clock.runs)
            if hook:
                hook(True)
            t0 = now()
            so = sched.schedule()
            sched.get_grammar_bitmask(so)
            t1 = now()
            if hook:
                hook(False)
            g1 = (clock.ns, clock.runs)
            evict()  # the forward runs, then the runner builds its output
            mro, live, prefill = runner.output(so, a.runner_order == "shuffled")
            g2 = (clock.ns, clock.runs)
            if hook:
                hook(True)
            t2 = now()
            outs = sched.update_from_output(so, mro)
            t3 = now()
            if hook:
                hook(False)
            g3 = (clock.ns, clock.runs)
            td = 0
            g4 = g5 = (clock.ns, clock.runs)
            if live and a.k:
                drafts = runner.drafts(live)
                g4 = (clock.ns, clock.runs)
                if hook:
                    hook(True)
                t4 = now()
                sched.update_draft_token_ids(drafts)
                td = now() - t4
                if hook:
                    hook(False)
                g5 = (clock.ns, clock.runs)
            finished = runner.consume(outs)
            if finished and not serve:
                raise RuntimeError("a request finished inside the window; raise --max-tokens")
            if finished and kept:
                kept = [r for r in kept if not r.is_finished()]  # freed here, untimed
            ta = sum(admit() for _ in range(finished))
            initial.difference_update(live)
            if state == "measure":
                total = (t1 - t0) + (t3 - t2) + td
                for ph, dt in zip(PHASES, (t1 - t0, t3 - t2, td, total, ta)):
                    times[ph].append(dt)
                # The collector's runs inside the timed phases (schedule, update, drafts).
                timed = ((g0, g1), (g2, g3), (g4, g5))
                gc_ns.append(sum(b[0] - a[0] for a, b in timed))
                gc_runs.append(sum(b[1] - a[1] for a, b in timed))
                scheduled.append(len(so.num_scheduled_tokens))
            elif state == "fill" and (
                (serve and not initial) or (not serve and prefill == 0 and len(live) == n)
            ):
                state = "warmup"
            elif state == "warmup":
                warm -= 1
                if warm <= 0:
                    state = "measure"
            if a.lifetimes == "engine":
                so = mro = outs = drafts = None  # freed here, untimed
    finally:
        if clock in gc.callbacks:
            gc.callbacks.remove(clock)
        gc.unfreeze()
    if not serve:
        assert min(scheduled) == n, "not every request was scheduled in every measured step"
    sched = None  # free it before collecting (the admit closure holds the cell)
    gc.collect()
    return {
        "side": side,
        "mode": mode,
        "n": n,
        "rep": rep,
        "steps": steps,
        "p50_us": {ph: statistics.median(v) / 1e3 for ph, v in times.items()},
        "p99_us": {ph: float(np.percentile(v, 99)) / 1e3 for ph, v in times.items()},
        **(
            {
                "gc_mean_us": statistics.mean(gc_ns) / 1e3,
                "gc_runs_per_step": statistics.mean(gc_runs),
            }
            if a.gc_stats
            else {}
        ),
    }


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    import torch
    import vllm

    from dflash_rs.bench.offline_vllm import OfflineVllm
    from dflash_rs.bench.stats import core_info

    ns = [int(x) for x in a.n.split(",")]
    modes = a.modes.split(",")
    sides = a.sides.split(",")
    cells = [(mode, n) for mode in modes for n in ns]
    runs = []
    with tempfile.TemporaryDirectory(prefix="dflash-rs-vllm-bench-") as root:
        offline = OfflineVllm(root)
        for rep in range(a.reps):
            for mode, n in cells:
                order = sides if rep % 2 == 0 else sides[::-1]
                for side in order:
                    t = time.perf_counter()
                    r = run_one(offline, side, mode, n, a, rep)
                    r["wall_s"] = time.perf_counter() - t
                    runs.append(r)
                    gc_note = (
                        f"; collector {r['gc_mean_us']:.1f} us, {r['gc_runs_per_step']:.2f} runs "
                        "a step (mean)"
                        if a.gc_stats
                        else ""
                    )
                    print(
                        f"rep {rep} {mode} N={n} {side:9s}: total p50 "
                        f"{r['p50_us']['total']:9.1f} us (schedule {r['p50_us']['schedule']:.1f}, "
                        f"update {r['p50_us']['update']:.1f}, drafts {r['p50_us']['drafts']:.1f}"
                        f"{gc_note}); {r['steps']} steps, {r['wall_s']:.0f} s",
                        file=sys.stderr,
                        flush=True,
                    )
    summary: dict[str, Any] = {}
    for mode, n in cells:
        cell = [r for r in runs if r["n"] == n and r["mode"] == mode]
        for side in sides:
            mine = [r for r in cell if r["side"] == side]
            summary[f"{side}/{mode}/{n}"] = {
                ph: statistics.median(r["p50_us"][ph] for r in mine) for ph in PHASES
            } | {"p99_total": statistics.median(r["p99_us"]["total"] for r in mine)}
        # Ratio of the two sides within each rep (run back to back), then the median: less
        # exposed to load that drifts between reps than the ratio of the medians.
        pairs = {r["rep"]: r["p50_us"]["total"] for r in cell if r["side"] == "vllm"}
        ratios = [
            pairs[r["rep"]] / r["p50_us"]["total"]
            for r in cell
            if r["side"] == "dflash-rs" and r["rep"] in pairs
        ]
        if ratios:
            summary[f"paired_ratio/{mode}/{n}"] = {
                "median": statistics.median(ratios),
                "min": min(ratios),
                "max": max(ratios),
            }
    doc = {
        "args": vars(a),
        "versions": {
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            **core_info(),
            "numpy": np.__version__,
            "python": platform.python_version(),
        },
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
        "summary": summary,
    }
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    if a.markdown:
        x = "\u00d7"
        evicted = f"; {a.evict_kib} KiB swept before schedule and update" if a.evict_kib else ""
        print(f"Object lifetimes: {a.lifetimes}{evicted}; {a.reps} reps; CPU time.\n")
        print(
            f"| mode | N | vLLM {vllm.__version__} `Scheduler` p50 (µs) | `DFlashRsScheduler` p50 "
            "(µs) | ratio | paired ratio (min-max) | vLLM schedule / update / drafts "
            "| ours schedule / update / drafts |"
        )
        print("|---|---:|---:|---:|---:|---:|---|---|")
        for mode, n in cells:
            v, d = summary.get(f"vllm/{mode}/{n}"), summary.get(f"dflash-rs/{mode}/{n}")
            pr = summary.get(f"paired_ratio/{mode}/{n}")
            if not v or not d or not pr:
                continue
            print(
                f"| {mode} | {n} | {v['total']:,.0f} | {d['total']:,.0f} "
                f"| {v['total'] / d['total']:.1f}{x} "
                f"| {pr['median']:.1f}{x} ({pr['min']:.1f}-{pr['max']:.1f}) "
                f"| {v['schedule']:,.0f} / {v['update']:,.0f} / {v['drafts']:,.0f} "
                f"| {d['schedule']:,.0f} / {d['update']:,.0f} / {d['drafts']:,.0f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
