#!/usr/bin/env python3
"""Alternated A/B of `_core` builds: the per-step cost of each, measured run by run in turn.

This host's speed drifts by up to 30% within minutes, so two builds measured one after the other
differ by more than most changes do. This script runs `scheduler_bench.py` once per build per
round, rotating which build goes first, and reports each build's median and, for every build
after the first, the median of its paired ratios to the first build (same round) with a 95%
bootstrap interval. Pass the same build twice for an A/A check of the noise.

Each build runs from its own copy of the package (the `_core` given, everything else from
`python/dflash_rs`), so rebuilding the editable extension mid-run changes nothing. A build
given as `CORE.so@DIR` takes its Python from the package directory DIR instead (a checkout of
another commit: `git worktree add /tmp/before HEAD~1`, then `.../before.so@/tmp/before/python/
dflash_rs`), for changes that touch both sides.

With `--modes micro` the admission cost (Request() + add_request(), per prompt length) is
reported as the total of an `admit` row.

With `--bench dropin` it runs `vllm_dropin.py` instead (`DFlashRsScheduler` inside vLLM's
objects, our side only), with the vLLM venv's interpreter (`--python`, default .venv-vllm);
its phases are schedule, update, drafts and total.

Example (decode at N = 1024, 30 rounds):

  .venv/bin/python benches/ab_builds.py /tmp/before.so /tmp/after.so --rounds 30 \\
      -- --n-reqs 1024 --modes decode

The drop-in (after `scripts/vllm_env.sh setup`), 10 rounds:

  .venv/bin/python benches/ab_builds.py /tmp/before.so /tmp/after.so --rounds 10 \\
      --bench dropin -- --n 256,1024 --modes decode,serve
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PACKAGE = os.path.join(REPO, "python", "dflash_rs")
BENCH = os.path.join(HERE, "scheduler_bench.py")
DROPIN = os.path.join(HERE, "vllm_dropin.py")
PHASES = ("schedule_p50_us", "spec_p50_us", "update_p50_us", "drafts_p50_us", "total_p50_us")
FIXED = ["--reps", "1", "--clock", "cpu", "--preempt-n", "0"]
#: vllm_dropin.py's phases, in the order of PHASES (it has no separate spec phase).
DROPIN_PHASES = ("schedule", None, "update", "drafts", "total")


def split_build(build: str) -> tuple[str, str]:
    """`CORE.so[@PACKAGE_DIR]` -> (the extension, the package its Python comes from)."""
    so, _, package = build.partition("@")
    return so, package or PACKAGE


def snapshot(build: str, root: str, index: int) -> str:
    """A copy of the build's package with its extension; returns the directory to put on
    PYTHONPATH."""
    so, package = split_build(build)
    dst = os.path.join(root, f"build{index}")
    shutil.copytree(
        package,
        os.path.join(dst, "dflash_rs"),
        ignore=shutil.ignore_patterns("__pycache__", "_core*.so"),
    )
    shutil.copy(so, os.path.join(dst, "dflash_rs", "_core.abi3.so"))
    return dst


def sha16(path: str) -> str:
    """The first 16 hex digits of a file's sha256 (as scheduler_bench reports its core)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def run_once(
    path: str, bench_args: list[str], out: str, expect_core: str, input_path: str
) -> dict[tuple[str, int], dict]:
    """One scheduler_bench run against the package in `path` on the `input_path` API:
    {(mode, n): aggregate row}."""
    env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, BENCH, "--paths", input_path, *FIXED, *bench_args, "--json", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd="/")
    with open(out) as f:
        doc = json.load(f)
    loaded = doc["versions"].get("core_so_sha256")
    if loaded != expect_core:
        raise SystemExit(f"the run loaded core {loaded}, not the snapshot's {expect_core}")
    rows = {(row["mode"], row["n"]): row for row in doc["aggregate"] if row["path"] == input_path}
    # Admission (`--modes micro`): Request() + add_request() of a prompt, as the total.
    for name, stats in (doc.get("micro_aggregate") or {}).items():
        kind, size, path = name.rsplit("_", 2)
        if kind == "admit" and path == input_path:
            row = {p: float("nan") for p in PHASES}
            row["total_p50_us"] = stats["p50_us"]
            rows[("admit", int(size))] = row
    return rows


def run_dropin_once(
    path: str, python: str, bench_args: list[str], out: str, expect_core: str
) -> dict[tuple[str, int], dict]:
    """One vllm_dropin.py run (our side) against the package in `path`: {(mode, n): row}."""
    env = dict(os.environ, PYTHONPATH=path, OPENBLAS_NUM_THREADS="1")
    cmd = [python, DROPIN, "--sides", "dflash-rs", "--reps", "1", *bench_args, "--json", out]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(out) as f:
        doc = json.load(f)
    loaded = doc["versions"].get("core_so_sha256")
    if loaded != expect_core:
        raise SystemExit(f"the run loaded core {loaded}, not the snapshot's {expect_core}")
    rows = {}
    for run in doc["runs"]:
        p50 = run["p50_us"]
        rows[(run["mode"], run["n"])] = {
            p: (float("nan") if d is None else p50[d]) for p, d in zip(PHASES, DROPIN_PHASES)
        }
    return rows


def bootstrap_median(values: np.ndarray, rng: np.random.Generator) -> tuple[float, float]:
    """95% bootstrap interval of the median."""
    samples = rng.choice(values, size=(2000, len(values)), replace=True)
    medians = np.median(samples, axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "builds", nargs="+", help="_core.abi3.so files (2 or more), each optionally @PACKAGE_DIR"
    )
    parser.add_argument("--rounds", type=int, default=20, help="runs of every build")
    parser.add_argument(
        "--path",
        choices=("arrays", "lists", "lists_spec_dict"),
        default="arrays",
        help="the API the bench drives (see dflash-rs bench --help)",
    )
    parser.add_argument(
        "--bench",
        choices=("scheduler", "dropin"),
        default="scheduler",
        help="scheduler_bench.py (the core through --path) or vllm_dropin.py (vLLM's objects)",
    )
    parser.add_argument(
        "--python",
        default=os.path.join(REPO, ".venv-vllm", "bin", "python"),
        help="--bench dropin: the interpreter of a venv with vLLM",
    )
    parser.add_argument("--json", help="write every run's numbers here")
    args, bench_args = parser.parse_known_args()
    bench_args = [a for a in bench_args if a != "--"]
    if len(args.builds) < 2:
        parser.error("give at least two builds (the same one twice for an A/A check)")
    labels = [f"{i}:{os.path.basename(split_build(b)[0])}" for i, b in enumerate(args.builds)]
    # results[build][(mode, n)][phase] -> list over rounds
    results: list[dict] = [{} for _ in args.builds]
    with tempfile.TemporaryDirectory(prefix="ab_builds_") as root:
        paths = [snapshot(so, root, i) for i, so in enumerate(args.builds)]
        cores = [sha16(split_build(b)[0]) for b in args.builds]
        out = os.path.join(root, "run.json")
        for r in range(args.rounds):
            order = [(r + k) % len(paths) for k in range(len(paths))]
            for b in order:
                if args.bench == "dropin":
                    rows = run_dropin_once(paths[b], args.python, bench_args, out, cores[b])
                else:
                    rows = run_once(paths[b], bench_args, out, cores[b], args.path)
                for key, row in rows.items():
                    per = results[b].setdefault(key, {p: [] for p in PHASES})
                    for p in PHASES:
                        per[p].append(row[p])
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    rng = np.random.default_rng(0)
    print("bench: vllm_dropin.py" if args.bench == "dropin" else f"path: {args.path}")
    print(
        "| config | build | schedule | spec | update | drafts | total p50 (median) "
        "| total vs build 0 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for key in sorted(results[0]):
        base = np.array(results[0][key]["total_p50_us"])
        for b, label in enumerate(labels):
            per = results[b][key]
            med = [float(np.median(per[p])) for p in PHASES]
            if b == 0:
                vs = "-"
            else:
                ratio = np.array(per["total_p50_us"]) / base
                lo, hi = bootstrap_median(ratio, rng)
                vs = f"{np.median(ratio):.3f}x [{lo:.3f}, {hi:.3f}]"
            print(
                f"| {key[0]} N={key[1]} | {label} | {med[0]:.1f} | {med[1]:.1f} | "
                f"{med[2]:.1f} | {med[3]:.1f} | {med[4]:.1f} | {vs} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "builds": args.builds,
                    "path": args.path,
                    "bench_args": bench_args,
                    "results": [{f"{m}/{n}": v for (m, n), v in res.items()} for res in results],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
