#!/usr/bin/env python3
"""Side-by-side: vLLM 0.33's Python scheduler vs dflash-rs's, same workload, same session.

Runs vLLM's scheduler anchor harness (`bench_vllm_scheduler.py`, kept outside this repository:
pass it with --harness or DFLASH_RS_VLLM_HARNESS) in its own venv (vLLM's torch/numpy never load
into our process) and `benches/scheduler_bench.py` in ours, with identical workload arguments,
interleaved rep by rep (vLLM rep 0, ours rep 0, vLLM rep 1, ...), then prints one table with
both medians and the ratios (vLLM / ours).

Also, in the vLLM venv, it times vLLM's admission of a request (Request() with the engine's
sha256 block hasher + SamplingParams, then Scheduler.add_request) on the same pre-generated
1,100-token prompts as our `micro` mode, and (with --check-prompts) checks that the prompts our
generator makes are identical to the harness's for every config seed (sha256 per prompt).

Setup of the vLLM venv (once, about 4 minutes and 9.4 GB):
  python3 -m venv .venv-vllm && PIP_CONFIG_FILE=/dev/null .venv-vllm/bin/pip install vllm==0.33.0

Example:
  .venv/bin/python benches/compare_vllm.py --n-reqs 64,256,1024 --reps 3 \
      --check-prompts 64 --trace --out-dir /tmp/sched-compare --markdown /tmp/sched-compare/table.md

Worker modes (run by this script inside the vLLM venv; not for direct use):
  --worker prompts  hashes of the harness generator's prompts
  --worker admit    vLLM Request() + add_request() timings
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_HARNESS = os.environ.get("DFLASH_RS_VLLM_HARNESS")
DEFAULT_VLLM_PY = os.path.join(REPO, ".venv-vllm", "bin", "python")
OUR_BENCH = os.path.join(HERE, "scheduler_bench.py")

# The product's targets (per step through Python, p50, microseconds).
TARGETS_US = {
    ("decode", 1024): 300.0,
    ("decode", 256): 80.0,
    ("serve", 256): 120.0,
    ("admit", 1100): 10.0,
}
TRACE_FIELDS = (
    "sched_reqs",
    "sched_tokens",
    "prefill_reqs",
    "preempted",
    "finished",
    "accepted",
    "drafted",
)


# --------------------------------------------------------------------------
# workers (run inside the vLLM venv)
# --------------------------------------------------------------------------
def load_harness(path):
    spec = importlib.util.spec_from_file_location("bench_vllm_scheduler", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # module level imports numpy only; vllm loads in Ctx()
    return mod


def worker_prompts(a):
    """sha256 of the harness generator's first prompts per seed (no vllm import)."""
    import hashlib

    import numpy as np

    h = load_harness(a.harness)
    wargs = SimpleNamespace(
        prefix_len=a.prefix_len, min_prompt=a.min_prompt, max_prompt=a.max_prompt
    )
    ctx = SimpleNamespace(args=wargs)
    doc = {}
    for seed in a.seeds:
        wl = h.Workload(ctx, seed, None)
        doc[str(seed)] = [
            hashlib.sha256(np.asarray(wl.prompt(i), dtype="<i8").tobytes()).hexdigest()
            for i in range(a.count)
        ]
    doc["_vllm_imported"] = "vllm" in sys.modules
    print(json.dumps(doc))


def worker_harness(a):
    """The harness's own main(), with its clock swapped for thread CPU time (--clock cpu)."""
    h = load_harness(a.harness)
    if a.clock == "cpu":
        h.pc = time.thread_time_ns
    h.main(json.loads(a.harness_argv))


def worker_admit(a):
    """vLLM: Request(prompt, SamplingParams, block_hasher) + add_request, each timed, on the
    same prompts as scheduler_bench.py's micro mode (rng seed+rep, uniform [3, 32000))."""
    import gc

    import numpy as np

    h = load_harness(a.harness)
    hargs = SimpleNamespace(
        model_dir=None,
        max_model_len=8192,
        max_num_batched_tokens=16384,
        block_size=16,
        no_log_stats=False,
        num_spec_tokens=8,
    )
    ctx = h.Ctx(hargs)
    out = {
        "vllm": ctx.vllm.__version__,
        "torch": ctx.torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "reps": [],
    }
    for rep in range(a.reps):
        rng = np.random.default_rng(a.seed + rep)
        res = {}
        for L in sorted({a.prompt_len, 16}):
            prompts = rng.integers(3, 32000, (a.iters, L)).tolist()
            sched, _, hasher = ctx.build("dflash", 4096, 1024)
            ctx.freeze_gc_heap()
            Request, SP = ctx.Request, ctx.SamplingParams
            sched.add_request(
                Request(
                    request_id="warm",
                    prompt_token_ids=prompts[0],
                    sampling_params=SP(max_tokens=16),
                    pooling_params=None,
                    block_hasher=hasher,
                )
            )
            times = []
            pc = time.perf_counter_ns if a.clock == "wall" else time.thread_time_ns
            for i, p in enumerate(prompts):
                rid = f"m{i}"
                t0 = pc()
                r = Request(
                    request_id=rid,
                    prompt_token_ids=p,
                    sampling_params=SP(max_tokens=16),
                    pooling_params=None,
                    block_hasher=hasher,
                )
                sched.add_request(r)
                times.append(pc() - t0)
            arr = np.asarray(times, dtype=np.float64) / 1e3
            res[f"admit_{L}_lists"] = {
                "p50_us": float(np.percentile(arr, 50)),
                "p99_us": float(np.percentile(arr, 99)),
                "mean_us": float(arr.mean()),
            }
            gc.unfreeze()
            del sched
            gc.collect()
        out["reps"].append(res)
    print(json.dumps(out))


# --------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------
def run(cmd, log, env=None, cwd=None):
    print("$ " + " ".join(cmd), flush=True)
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    t0 = time.perf_counter()
    p = subprocess.run(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd
    )
    log.write(p.stdout)
    log.flush()
    if p.returncode != 0:
        print(p.stdout[-4000:])
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(cmd)}")
    print(f"  ({time.perf_counter() - t0:.1f}s)", flush=True)
    return p.stdout


def median(xs):
    xs = sorted(x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x)))
    if not xs:
        return float("nan")
    k = len(xs)
    return xs[k // 2] if k % 2 else 0.5 * (xs[k // 2 - 1] + xs[k // 2])


def load_aggs(paths, ours: bool):
    """{(mode, spec, n[, path]): {stat: median over files}} from per-rep JSONs."""
    per = {}
    for p in paths:
        with open(p) as f:
            doc = json.load(f)
        for row in doc["aggregate"]:
            key = (row["mode"], row["spec"], row["n"]) + ((row["path"],) if ours else ())
            per.setdefault(key, []).append(row)
    out = {}
    for key, rows in per.items():
        out[key] = {
            k: median([r.get(k) for r in rows])
            for k in rows[0]
            if isinstance(rows[0][k], (int, float)) and k != "n"
        }
        out[key]["reps"] = len(rows)
    return out


def trace_diff(vllm_trace, our_trace, path="arrays"):
    """Compare per-step scheduling decisions (first rep of each config)."""

    def read(p, want_path=None):
        runs = {}
        with open(p) as f:
            for line in f:
                r = json.loads(line)
                if want_path and r.get("path") != want_path:
                    continue
                runs.setdefault((r["mode"], r["spec"], r["n"]), []).append(r)
        return runs

    v, o = read(vllm_trace), read(our_trace, path)
    res = {}
    for key in sorted(set(v) & set(o)):
        vs, os_ = v[key], o[key]
        n = min(len(vs), len(os_))
        first = None
        same = 0
        for i in range(n):
            a = tuple(vs[i][f] for f in TRACE_FIELDS)
            b = tuple(os_[i][f] for f in TRACE_FIELDS)
            if a == b:
                same += 1
            elif first is None:
                first = {
                    "step": vs[i]["step"],
                    "vllm": dict(zip(TRACE_FIELDS, a)),
                    "ours": dict(zip(TRACE_FIELDS, b)),
                }
        res["/".join(map(str, key))] = {
            "steps_vllm": len(vs),
            "steps_ours": len(os_),
            "identical_steps": same,
            "first_difference": first,
        }
    return res


def fmt(x, nd=1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:,.{nd}f}"


def ratio(a, b):
    if a is None or b is None or not b or math.isnan(a) or math.isnan(b):
        return "-"
    return f"{a / b:,.0f}x" if a / b >= 10 else f"{a / b:,.1f}x"


def build_table(v, o, vadmit, oadmit, spec, n_list, modes, preempt_n, prompt_len):
    lines = []
    hdr = (
        "| workload | N | vLLM total p50 (µs) | ours total p50, arrays (µs) | ratio | "
        "ours total p50, lists (µs) | ratio | target | met? |"
    )
    lines.append(hdr)
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|:---:|")
    rows = [(m, n) for m in modes for n in n_list]
    if preempt_n:
        rows.append(("preempt", preempt_n))
    for mode, n in rows:
        vv = v.get((mode, spec, n))
        oa = o.get((mode, spec, n, "arrays"))
        ol = o.get((mode, spec, n, "lists"))
        if not vv and not oa:
            continue
        vt = vv["total_p50_us"] if vv else None
        at = oa["total_p50_us"] if oa else None
        lt = ol["total_p50_us"] if ol else None
        tgt = TARGETS_US.get((mode, n))
        met = "-" if tgt is None or at is None else ("yes" if at <= tgt else "**no**")
        label = {
            "decode": "decode (all running)",
            "serve": "serve (mixed)",
            "preempt": "preempt (25% blocks)",
        }[mode]
        lines.append(
            f"| {label}, {spec} K=8 | {n} | {fmt(vt, 0)} | {fmt(at)} | {ratio(vt, at)} "
            f"| {fmt(lt)} | {ratio(vt, lt)} | "
            f"{'<= ' + fmt(tgt, 0) if tgt else '-'} | {met} |"
        )
    if vadmit or oadmit:
        key = f"admit_{prompt_len}"
        vt = vadmit.get(f"{key}_lists", {}).get("p50_us") if vadmit else None
        at = oadmit.get(f"{key}_arrays", {}).get("p50_us") if oadmit else None
        lt = oadmit.get(f"{key}_lists", {}).get("p50_us") if oadmit else None
        tgt = TARGETS_US.get(("admit", 1100))
        met = "-" if at is None else ("yes" if at <= tgt else "**no**")
        lines.append(
            f"| admit one {prompt_len}-token request (Request() + add_request) | 1 | "
            f"{fmt(vt)} | {fmt(at, 2)} | {ratio(vt, at)} | {fmt(lt, 2)} | "
            f"{ratio(vt, lt)} | <= {fmt(tgt, 0)} | {met} |"
        )
    return "\n".join(lines)


def build_phase_table(v, o, spec, n_list, modes, preempt_n):
    lines = [
        "| workload | N | side | run | tok/step | schedule p50 | update p50 | drafts p50 | "
        "spec-dict p50 | total p50 | total p99 | admit/req p50 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(m, n) for m in modes for n in n_list]
    if preempt_n:
        rows.append(("preempt", preempt_n))
    for mode, n in rows:
        for side, agg in (
            ("vLLM", v.get((mode, spec, n))),
            ("ours arrays", o.get((mode, spec, n, "arrays"))),
            ("ours lists", o.get((mode, spec, n, "lists"))),
        ):
            if not agg:
                continue
            admit = agg.get("admit_req_p50_us")
            if side == "vLLM":
                # harness records admit per step; per request = mean per step / mean finished
                fin = agg.get("mean_finished")
                admit = (agg["admit_mean_us"] / fin) if fin else None
            lines.append(
                f"| {mode} | {n} | {side} | {fmt(agg.get('mean_running'), 0)} | "
                f"{fmt(agg.get('mean_sched_tokens'), 0)} | {fmt(agg.get('schedule_p50_us'))} | "
                f"{fmt(agg.get('update_p50_us'))} | {fmt(agg.get('drafts_p50_us'))} | "
                f"{fmt(agg.get('spec_p50_us')) if side != 'vLLM' else '-'} | "
                f"{fmt(agg.get('total_p50_us'))} | {fmt(agg.get('total_p99_us'))} | "
                f"{fmt(admit)} |"
            )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--worker", choices=["prompts", "admit", "harness"], help=argparse.SUPPRESS)
    p.add_argument("--harness-argv", default="[]", help=argparse.SUPPRESS)
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--iters", type=int, default=2000, help=argparse.SUPPRESS)
    p.add_argument("--prompt-len", type=int, default=1100, help=argparse.SUPPRESS)

    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PY)
    p.add_argument("--our-python", default=sys.executable)
    p.add_argument(
        "--harness",
        default=DEFAULT_HARNESS,
        required=DEFAULT_HARNESS is None,
        help="vLLM's bench_vllm_scheduler.py (default: $DFLASH_RS_VLLM_HARNESS)",
    )
    p.add_argument("--n-reqs", default="64,256,1024")
    p.add_argument("--spec", default="dflash")
    p.add_argument("--modes", default="decode,serve")
    p.add_argument("--preempt-n", type=int, default=256, help="0: no preempt run")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--num-spec-tokens", type=int, default=8)
    p.add_argument("--gc", default="engine", choices=["engine", "off"])
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: perf_counter_ns, as the harness; cpu: thread_time_ns on both "
        "sides (the harness is then run through its main() with its clock "
        "swapped), robust to other jobs on a busy machine",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument(
        "--micro-iters",
        type=int,
        default=2000,
        help="admissions per rep for the admit comparison (0: skip)",
    )
    p.add_argument("--micro-prompt-len", type=int, default=1100)
    p.add_argument("--paths", default="arrays,lists")
    p.add_argument(
        "--no-snapshot",
        dest="snapshot",
        action="store_false",
        help="run ours against the live package instead of a copy taken at start",
    )
    p.add_argument(
        "--snapshot-from",
        default=None,
        metavar="DIR",
        help="copy this dflash_rs package directory instead of the installed one "
        "(to run several comparisons against one build)",
    )
    p.add_argument(
        "--check-prompts",
        type=int,
        default=0,
        metavar="COUNT",
        help="verify the first COUNT prompts of every seed against the harness",
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="write per-step traces on rep 0 and diff the scheduling decisions",
    )
    p.add_argument("--out-dir", default="/tmp/dflash-sched-compare")
    p.add_argument("--markdown", default=None, help="also write the tables here")
    a = p.parse_args(argv)

    if a.worker == "prompts":
        return worker_prompts(a)
    if a.worker == "harness":
        return worker_harness(a)
    if a.worker == "admit":
        a.iters, a.prompt_len = a.micro_iters, a.micro_prompt_len
        return worker_admit(a)

    a.vllm_python, a.harness, a.out_dir = (
        os.path.abspath(x) for x in (a.vllm_python, a.harness, a.out_dir)
    )
    if not os.path.exists(a.vllm_python):
        raise SystemExit(
            f"{a.vllm_python} not found; create it with: python3 -m venv "
            ".venv-vllm && PIP_CONFIG_FILE=/dev/null .venv-vllm/bin/pip install "
            "vllm==0.33.0"
        )
    os.makedirs(a.out_dir, exist_ok=True)
    log = open(os.path.join(a.out_dir, "compare.log"), "a")
    t_start = time.perf_counter()
    n_list = [int(x) for x in a.n_reqs.split(",")]
    modes = [m for m in a.modes.split(",") if m]
    wl_args = [
        "--n-reqs",
        a.n_reqs,
        "--spec",
        a.spec,
        "--num-spec-tokens",
        str(a.num_spec_tokens),
        "--gc",
        a.gc,
        "--seed",
        str(a.seed),
        "--prefix-len",
        str(a.prefix_len),
        "--min-prompt",
        str(a.min_prompt),
        "--max-prompt",
        str(a.max_prompt),
        "--preempt-n",
        str(a.preempt_n),
    ]
    ours_env = dict(os.environ)
    if a.snapshot:
        # Other builds may replace the editable extension mid-run: copy the package once and
        # run every rep of ours against that copy.
        src = (
            a.snapshot_from
            or subprocess.run(
                [
                    a.our_python,
                    "-c",
                    "import dflash_rs, os; print(os.path.dirname(dflash_rs.__file__))",
                ],
                check=True,
                capture_output=True,
                text=True,
                cwd="/",
            ).stdout.strip()
        )
        dst = os.path.join(a.out_dir, "pkg")
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(
            src, os.path.join(dst, "dflash_rs"), ignore=shutil.ignore_patterns("__pycache__")
        )
        ours_env["PYTHONPATH"] = dst + os.pathsep + ours_env.get("PYTHONPATH", "")
        print(f"running ours against a snapshot of {src} in {dst}")
    vllm_env = dict(os.environ)
    # vLLM runs from a neutral directory: its model-inspection subprocess (`python -m ...`)
    # puts the cwd on sys.path, and this repo's top-level `kernels/` package would shadow the
    # PyPI `kernels` package that transformers probes.
    vllm_cwd = a.out_dir

    git = {}
    for key, cmd in (
        ("head", ["git", "rev-parse", "--short", "HEAD"]),
        ("dirty_rust", ["git", "status", "--short", "--", "rust"]),
    ):
        try:
            git[key] = subprocess.run(
                cmd, capture_output=True, text=True, cwd=REPO, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    report = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "args": vars(a),
        "git": git,
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }
    if a.check_prompts:
        seeds = sorted(
            {a.seed + 1000 * n for n in n_list}
            | ({a.seed + 1000 * a.preempt_n} if a.preempt_n else set())
        )
        theirs = json.loads(
            run(
                [
                    a.vllm_python,
                    os.path.abspath(__file__),
                    "--worker",
                    "prompts",
                    "--harness",
                    a.harness,
                    "--seeds",
                    ",".join(map(str, seeds)),
                    "--count",
                    str(a.check_prompts),
                    "--prefix-len",
                    str(a.prefix_len),
                    "--min-prompt",
                    str(a.min_prompt),
                    "--max-prompt",
                    str(a.max_prompt),
                ],
                log,
                vllm_env,
                vllm_cwd,
            )
            .strip()
            .splitlines()[-1]
        )
        ours = json.loads(
            run(
                [a.our_python, OUR_BENCH, "--dump-prompt-hashes", str(a.check_prompts), *wl_args],
                log,
                ours_env,
            )
            .strip()
            .splitlines()[-1]
        )
        ok = all(theirs[str(s)] == ours[str(s)] for s in seeds)
        report["prompt_check"] = {
            "seeds": seeds,
            "count": a.check_prompts,
            "identical": ok,
            "harness_imported_vllm": theirs["_vllm_imported"],
        }
        print(
            f"prompt check: first {a.check_prompts} prompts of seeds {seeds}: "
            f"{'IDENTICAL' if ok else 'DIFFERENT'} (harness generator run in the vLLM venv)"
        )
        if not ok:
            raise SystemExit("our workload generator does not match the harness's")

    vjsons, ojsons, vadmits = [], [], []
    vtrace = otrace = None
    for rep in range(a.reps):
        vj = os.path.join(a.out_dir, f"vllm_rep{rep}.json")
        hargv = [
            "--reps",
            "1",
            "--modes",
            ",".join(m for m in modes if m in ("decode", "serve")),
            "--preempt-spec",
            a.spec,
            "--micro-iters",
            "0",
            "--json-out",
            vj,
            *wl_args,
        ]
        if a.trace and rep == 0:
            vtrace = os.path.join(a.out_dir, "vllm_trace.jsonl")
            hargv += ["--trace-out", vtrace]
        if a.clock == "wall":
            cmd = [a.vllm_python, a.harness, *hargv]
        else:
            cmd = [
                a.vllm_python,
                os.path.abspath(__file__),
                "--worker",
                "harness",
                "--harness",
                a.harness,
                "--clock",
                a.clock,
                "--harness-argv",
                json.dumps(hargv),
            ]
        run(cmd, log, vllm_env, vllm_cwd)
        vjsons.append(vj)
        if a.micro_iters:
            out = run(
                [
                    a.vllm_python,
                    os.path.abspath(__file__),
                    "--worker",
                    "admit",
                    "--harness",
                    a.harness,
                    "--reps",
                    "1",
                    "--seed",
                    str(a.seed + rep),
                    "--micro-iters",
                    str(a.micro_iters),
                    "--micro-prompt-len",
                    str(a.micro_prompt_len),
                    "--clock",
                    a.clock,
                ],
                log,
                vllm_env,
                vllm_cwd,
            )
            vadmits.append(json.loads(out.strip().splitlines()[-1]))
        oj = os.path.join(a.out_dir, f"ours_rep{rep}.json")
        our_modes = [m for m in modes if m in ("decode", "serve")]
        if a.preempt_n:
            our_modes.append("preempt")
        if a.micro_iters:
            our_modes.append("micro")
        cmd = [
            a.our_python,
            OUR_BENCH,
            "--reps",
            "1",
            "--modes",
            ",".join(our_modes),
            "--paths",
            a.paths,
            "--micro-iters",
            str(a.micro_iters),
            "--micro-prompt-len",
            str(a.micro_prompt_len),
            "--json",
            oj,
            "--quiet",
            "--clock",
            a.clock,
            *wl_args,
        ]
        cmd += ["--micro-seed", str(a.seed + rep)]  # same prompts as the vLLM admit worker
        if a.trace and rep == 0:
            otrace = os.path.join(a.out_dir, "ours_trace.jsonl")
            cmd += ["--trace-out", otrace]
        run(cmd, log, ours_env)
        ojsons.append(oj)

    v = load_aggs(vjsons, ours=False)
    o = load_aggs(ojsons, ours=True)
    vadmit = {}
    if vadmits:
        keys = vadmits[0]["reps"][0].keys()
        vadmit = {
            k: {
                s: median([r["reps"][0][k][s] for r in vadmits])
                for s in ("p50_us", "p99_us", "mean_us")
            }
            for k in keys
        }
    oadmit = {}
    omicro = []
    for j in ojsons:
        with open(j) as f:
            doc = json.load(f)
        if doc.get("micro_runs"):
            omicro.append(doc["micro_runs"][0])
    if omicro:
        oadmit = {
            k: {s: median([m[k][s] for m in omicro]) for s in ("p50_us", "p99_us", "mean_us")}
            for k, val in omicro[0].items()
            if isinstance(val, dict)
        }

    with open(vjsons[0]) as f:
        vdoc = json.load(f)
    with open(ojsons[0]) as f:
        odoc = json.load(f)
    table = build_table(
        v, o, vadmit, oadmit, a.spec, n_list, modes, a.preempt_n, a.micro_prompt_len
    )
    phases = build_phase_table(v, o, a.spec, n_list, modes, a.preempt_n)
    admit_lines = [
        "| admission, µs per request (p50 / p99) | vLLM | ours arrays | ours lists |",
        "|---|---:|---:|---:|",
    ]
    for L in sorted({a.micro_prompt_len, 16}):

        def pp(d, k):
            x = d.get(k)
            return f"{fmt(x['p50_us'], 2)} / {fmt(x['p99_us'], 2)}" if x else "-"

        admit_lines.append(
            f"| {L}-token prompt | {pp(vadmit, f'admit_{L}_lists')} | "
            f"{pp(oadmit, f'admit_{L}_arrays')} | "
            f"{pp(oadmit, f'admit_{L}_lists')} |"
        )
    admit_tbl = "\n".join(admit_lines)
    report.update(
        {
            "vllm_versions": vdoc.get("versions"),
            "our_versions": odoc.get("versions"),
            "machine": odoc.get("machine"),
            "vllm": v and {"/".join(map(str, k)): x for k, x in v.items()},
            "ours": {"/".join(map(str, k)): x for k, x in o.items()},
            "vllm_admit": vadmit,
            "ours_admit": oadmit,
            "total_wall_s": time.perf_counter() - t_start,
        }
    )
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    if vtrace and otrace:
        report["trace_diff"] = trace_diff(vtrace, otrace)
    text = [
        f"Side by side, same session ({report['started']}), {a.reps} reps interleaved "
        f"(vLLM, then ours, per rep); medians over reps of each rep's p50. ratio = vLLM / ours."
        f" Clock: {'perf_counter_ns (wall)' if a.clock == 'wall' else 'thread_time_ns (CPU)'}."
        f" Load average at start {report.get('loadavg_start')}, end {report.get('loadavg_end')}.",
        f"vLLM {vdoc['versions'].get('vllm')} (torch {vdoc['versions'].get('torch')}); "
        f"dflash_rs {odoc['versions'].get('dflash_rs')} (git {git.get('head')}"
        f"{', rust/ modified' if git.get('dirty_rust') else ''}; _core sha256 "
        f"{odoc['versions'].get('core_so_sha256')}, built {odoc['versions'].get('core_so_mtime')})"
        f"; python {odoc['machine'].get('python')}, numpy {odoc['versions'].get('numpy')}; "
        f"{odoc['machine'].get('cpu')}, nproc {odoc['machine'].get('nproc')}",
        "",
        table,
        "",
        "Per phase, µs (medians over reps):",
        "",
        phases,
        "",
        admit_tbl,
    ]
    if "trace_diff" in report:
        text += [
            "",
            "Scheduling decisions, rep 0 (per-step sched_reqs, sched_tokens, "
            "prefill_reqs, preempted, finished, accepted, drafted):",
        ]
        for key, d in report["trace_diff"].items():
            fd = d["first_difference"]
            n_steps = min(d["steps_vllm"], d["steps_ours"])
            line = f"- {key}: {d['identical_steps']} of {n_steps} simulated steps identical"
            if fd:
                line += (
                    f"; first difference at step {fd['step']}: vLLM {fd['vllm']} vs "
                    f"ours {fd['ours']}"
                )
            text.append(line)
    out = "\n".join(text)
    print()
    print(out)
    with open(os.path.join(a.out_dir, "compare.json"), "w") as f:
        json.dump(report, f, indent=1)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(out + "\n")
    print(
        f"\nwrote {os.path.join(a.out_dir, 'compare.json')}; total wall "
        f"{report['total_wall_s']:.0f}s"
    )


if __name__ == "__main__":
    main()
