"""``--baseline-python``: replay the same workload on vLLM's scheduler in another interpreter
(``vllm_driver.py``, shipped in this package) and compare it with ours."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dflash_rs.bench.stats import _f, markdown_table, median
from dflash_rs.bench.workload import prompt_hashes

# The spec-file parameters the driver needs (names of the bench's argparse destinations).
PARAMS = (
    "accept",
    "warmup_steps",
    "measure_steps",
    "max_sim_steps",
    "block_size",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "max_tokens",
    "decode_max_tokens",
    "prefix_len",
    "min_prompt",
    "max_prompt",
    "gc",
    "clock",
)
COMPARED = ("schedule", "update", "drafts", "total")
HASHED_PROMPTS = 8


def driver_path() -> str:
    """Path of ``vllm_driver.py`` (a plain file of this package, also in an installed wheel)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_driver.py")


def build_spec(args: Any, configs: Sequence[Tuple[str, str, int]]) -> Dict[str, Any]:
    params = {name: getattr(args, name) for name in PARAMS}
    params["K"] = args.num_spec_tokens
    return {
        "params": params,
        "reps": args.reps,
        "hash_prompts": HASHED_PROMPTS,
        "configs": [
            {
                "mode": mode,
                "method": spec,
                "n": n,
                "seed": args.seed + 1000 * n,
                "block_frac": args.preempt_block_frac if mode == "preempt" else 1.0,
            }
            for mode, spec, n in configs
        ],
    }


def run_driver(python: str, spec: Dict[str, Any], timeout: Optional[float] = None) -> Dict:
    """Run the driver under ``python`` from an empty temp dir (no repo package shadows vLLM's
    imports); its stdout is the JSON result, the tail of its stderr goes into errors."""
    # The driver runs from a temp dir: resolve a relative path or a bare name first.
    python = os.path.abspath(python) if os.sep in python else (shutil.which(python) or python)
    with tempfile.TemporaryDirectory(prefix="dflash-rs-bench-") as tmp:
        spec_file = os.path.join(tmp, "spec.json")
        with open(spec_file, "w") as f:
            json.dump(spec, f)
        done = subprocess.run(
            [python, driver_path(), spec_file],
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM driver failed under {python} (exit {done.returncode}):\n{tail}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"vLLM driver printed no JSON under {python}")
    return json.loads(lines[-1])


def aggregate(runs: List[Dict]) -> List[Dict[str, Any]]:
    """Median over reps of each per-rep p50/p99, per (mode, method, N)."""
    groups: Dict[Tuple[str, str, int], List[Dict]] = {}
    for r in runs:
        groups.setdefault((r["mode"], r["method"], r["n"]), []).append(r)
    out = []
    for (mode, method, n), rs in groups.items():
        row: Dict[str, Any] = {"mode": mode, "spec": method, "n": n, "reps": len(rs)}
        for phase in ("schedule", "grammar", "update", "drafts", "admit", "total"):
            for stat in ("p50_us", "p99_us"):
                vals = [r["timings"][phase][stat] for r in rs if r["timings"][phase]]
                row[f"{phase}_{stat}"] = median(vals)
        for key in ("sched_tokens", "running"):
            row[f"mean_{key}"] = median([r["means"][key] for r in rs])
        row["measured_steps"] = median([r["measured_steps"] for r in rs])
        out.append(row)
    return out


def prompts_identical(args: Any, doc: Dict) -> bool:
    """Whether the driver's prompts (sha256 of the first few per seed) equal ours."""
    theirs = doc.get("prompt_sha256", {})
    return bool(theirs) and all(
        prompt_hashes(args, int(seed), len(hashes)) == hashes for seed, hashes in theirs.items()
    )


def compare(ours: List[Dict], theirs: List[Dict]) -> List[Dict[str, Any]]:
    """One row per (mode, spec, N, path) of ours that vLLM also ran: both p50s and vLLM/ours."""
    by_key = {(r["mode"], r["spec"], r["n"]): r for r in theirs}
    rows = []
    for o in ours:
        v = by_key.get((o["mode"], o["spec"], o["n"]))
        if v is None:
            continue
        row: Dict[str, Any] = {k: o[k] for k in ("mode", "spec", "n", "path")}
        row["tok_per_step_ours"] = o["mean_sched_tokens"]
        row["tok_per_step_vllm"] = v["mean_sched_tokens"]
        for phase in COMPARED:
            a, b = o[f"{phase}_p50_us"], v[f"{phase}_p50_us"]
            row[f"{phase}_p50_us_ours"] = a
            row[f"{phase}_p50_us_vllm"] = b
            row[f"{phase}_ratio"] = b / a if a and a > 0 else float("nan")
        row["total_p99_us_ours"] = o["total_p99_us"]
        row["total_p99_us_vllm"] = v["total_p99_us"]
        rows.append(row)
    return rows


def fmt_compare(rows: List[Dict[str, Any]]) -> str:
    hdr = ["mode", "spec", "N", "path", "tok/step"]
    for phase in COMPARED:
        hdr += [f"{phase} vLLM", f"{phase} ours", "x"]
    table = [hdr]
    for r in rows:
        tok = _f(r["tok_per_step_ours"], 0)
        if _f(r["tok_per_step_vllm"], 0) != tok:
            tok += f" (vLLM {_f(r['tok_per_step_vllm'], 0)})"
        cells = [r["mode"], r["spec"], str(r["n"]), r["path"], tok]
        for phase in COMPARED:
            cells += [
                _f(r[f"{phase}_p50_us_vllm"]),
                _f(r[f"{phase}_p50_us_ours"]),
                _f(r[f"{phase}_ratio"]) + "x",
            ]
        table.append(cells)
    return markdown_table(table)
