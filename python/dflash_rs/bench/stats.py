"""Statistics and reporting of the scheduler benchmark: percentiles, medians over reps, the
per-config table (``markdown_table``), machine and version information."""

from __future__ import annotations

import hashlib
import math
import os
import platform
import time

import numpy as np

PHASES = ("schedule", "spec", "update", "drafts", "admit", "admit_req", "total")


def summarize_ns(xs):
    if not xs:
        return None
    arr = np.asarray(xs, dtype=np.float64) / 1e3  # -> microseconds
    return {
        "p50_us": float(np.percentile(arr, 50)),
        "p90_us": float(np.percentile(arr, 90)),
        "p99_us": float(np.percentile(arr, 99)),
        "mean_us": float(arr.mean()),
        "max_us": float(arr.max()),
        "n": int(arr.size),
    }


def median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(xs)) if xs else float("nan")


class GcCounter:
    def __init__(self):
        self.counts = [0, 0, 0]
        self.active = False

    def __call__(self, phase, info):
        if self.active and phase == "start":
            self.counts[info["generation"]] += 1


def machine_info():
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def aggregate(runs):
    """Median over repetitions of each per-run statistic."""
    agg = {}
    for key in PHASES:
        for stat in ("p50_us", "p99_us", "mean_us"):
            vals = [r["timings"][key][stat] for r in runs if r["timings"][key]]
            agg[f"{key}_{stat}"] = median(vals)
    for key in runs[0]["means"]:
        agg[f"mean_{key}"] = median([r["means"][key] for r in runs])
    agg["measured_steps"] = median([r["measured_steps"] for r in runs])
    agg["preempted_total"] = median([r["preempted_total"] for r in runs])
    agg["gc_gen2_in_window"] = median([r["gc_collections_in_window"][2] for r in runs])
    agg["reps"] = len(runs)
    return agg


def _f(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def markdown_table(table):
    """A markdown table of ``table`` (rows of strings, the header first), cells right-aligned
    and padded to their column's width."""
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = []
    for j, r in enumerate(table):
        lines.append("| " + " | ".join(c.rjust(widths[i]) for i, c in enumerate(r)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def fmt_table(rows):
    hdr = [
        "mode",
        "spec",
        "N",
        "path",
        "run",
        "tok/step",
        "pf/step",
        "sched p50",
        "sched p99",
        "spec p50",
        "update p50",
        "update p99",
        "drafts p50",
        "total p50",
        "total p99",
        "admit/req p50",
        "preempt",
        "gc2",
        "steps",
    ]
    table = [hdr]
    for (mode, spec, n, path), agg in rows:
        table.append(
            [
                mode,
                spec,
                str(n),
                path,
                _f(agg["mean_running"], 0),
                _f(agg["mean_sched_tokens"], 0),
                _f(agg["mean_prefill_reqs"]),
                _f(agg["schedule_p50_us"]),
                _f(agg["schedule_p99_us"]),
                _f(agg["spec_p50_us"]),
                _f(agg["update_p50_us"]),
                _f(agg["update_p99_us"]),
                _f(agg["drafts_p50_us"]),
                _f(agg["total_p50_us"]),
                _f(agg["total_p99_us"]),
                _f(agg["admit_req_p50_us"]),
                _f(agg["preempted_total"], 0),
                _f(agg["gc_gen2_in_window"], 0),
                _f(agg["measured_steps"], 0),
            ]
        )
    return markdown_table(table)


def parse_list(s, typ=str):
    return [typ(x) for x in s.split(",") if x.strip()]


def core_info():
    import dflash_rs

    info = {"dflash_rs": dflash_rs.__version__, "dflash_rs_path": dflash_rs.__file__}
    so = os.path.join(os.path.dirname(dflash_rs.__file__), "_core.abi3.so")
    try:
        st = os.stat(so)
        info["core_so_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))
        with open(so, "rb") as f:
            info["core_so_sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        pass
    return info
