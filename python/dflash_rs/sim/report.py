"""A simulation's results as a readable summary, a JSON document and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Union

import numpy as np

from dflash_rs.sim.metrics import SimResult

__all__ = ["JSON_KEYS", "summary", "to_json", "write_json", "write_plot"]

#: Keys every JSON report has (more may follow).
JSON_KEYS = (
    "ok",
    "steps",
    "requests_submitted",
    "requests_finished",
    "integrity_violations",
    "readback_mismatches",
    "foreign_writes",
    "ownership_violations",
    "table_mismatches",
    "kernel_mismatches",
    "invariant_failures",
    "sched_step_us_p50",
    "sched_step_us_p99",
    "sched_step_cpu_us_p50",
    "sched_step_cpu_us_p99",
    "preemptions",
    "resumed",
    "prefix_hit_rate",
    "acceptance_rate",
    "mean_acceptance_length",
    "kv_usage_max",
    "kv_usage_mean",
    "prompt_tokens",
    "computed_tokens",
    "generated_tokens",
    "slots_checked",
    "wall_s",
    "error",
    "violations",
    "config",
)


def _verdict(result: SimResult) -> str:
    if result.error is not None:
        return f"FAILED: the run stopped early ({result.error})"
    if result.ok:
        return "OK: every KV slot read back held its reader's own value"
    return "FAILED: KV integrity or ownership was violated (see above)"


def summary(result: SimResult) -> str:
    """A human-readable multi-line report."""
    cfg = result.config
    counts = result.verifier_counts
    method = (
        cfg["method"]
        if cfg["method"] == "none"
        else f"{cfg['method']} K={cfg['num_speculative_tokens']}"
    )
    lines: List[str] = [
        f"dflash-rs simulate: {method}, block size {cfg['block_size']}, "
        f"{cfg['num_blocks']} blocks, lookahead policy {cfg['lookahead_policy']}, policy "
        f"{cfg['policy']}, kernel {cfg['kernel']}, seed {cfg['seed']}",
        f"  requests     {result.requests_finished} finished of {result.requests_submitted} "
        f"submitted in {result.steps} steps ({_reasons(result.finish_reasons)})",
        f"  tokens       {result.prompt_tokens:,} prompt, {result.computed_tokens:,} computed, "
        f"{result.generated_tokens:,} generated, {result.draft_tokens_scheduled:,} drafts "
        "scheduled",
        f"  scheduler    per step p50 {result.sched_step_us(50):.1f} us, p99 "
        f"{result.sched_step_us(99):.1f} us (CPU time p50 {result.sched_step_us(50, True):.1f}"
        f" us, p99 {result.sched_step_us(99, True):.1f} us); schedule + update_from_output "
        f"+ drafts, {result.sched_s:.2f} s in all",
        f"  kv cache     usage max {result.kv_usage_max:.1%}, mean {result.kv_usage_mean:.1%}; "
        f"prefix hit rate {result.prefix_hit_rate:.1%}; {result.preemptions} preemptions, "
        f"{result.resumed} resumptions",
    ]
    if cfg["method"] != "none":
        lines.append(
            f"  speculation  acceptance {result.acceptance_rate:.1%} of draft tokens, "
            f"{result.mean_acceptance_length:.2f} tokens per verification step"
            + (
                f"; {result.drafter_skipped_rows} rows skipped drafting near max_model_len"
                if result.drafter_skipped_rows
                else ""
            )
        )
    lines += [
        f"  integrity    {result.integrity_violations} violations: "
        f"{_readback(counts)} read-back mismatches, {counts.get('foreign_writes', 0)} writes "
        f"outside the writer's blocks ({result.slots_checked:,} slot reads checked, "
        f"{result.kv_slots_written:,} slot writes)",
        f"  ownership    {result.ownership_violations} lanes outside owned blocks "
        f"({'strict kernel' if cfg['method'] == 'dflash' else 'block-table check'}); "
        f"{counts.get('table_mismatches', 0)} block-table mismatches, "
        f"{counts.get('kernel_mismatches', 0)} kernel mismatches; scheduler invariants "
        f"{result.invariant_checks - result.invariant_failures}/{result.invariant_checks} ok",
    ]
    if result.first_invariant_failure:
        lines.append(f"  invariant    first failure: {result.first_invariant_failure}")
    if result.violations:
        lines.append("  first violations:")
        lines += [f"    {v}" for v in result.violations[:8]]
    lines.append(f"  wall time    {result.wall_s:.1f} s")
    lines.append(_verdict(result))
    return "\n".join(lines)


def _readback(counts: Dict[str, int]) -> int:
    return sum(v for k, v in counts.items() if k.startswith("readback_"))


def _reasons(reasons: Dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())) or "none finished"


def to_json(result: SimResult) -> Dict[str, Any]:
    """The report as a JSON-ready dict (keys in ``JSON_KEYS`` first)."""
    counts = result.verifier_counts
    doc: Dict[str, Any] = {
        "ok": result.ok,
        "steps": result.steps,
        "requests_submitted": result.requests_submitted,
        "requests_finished": result.requests_finished,
        "integrity_violations": result.integrity_violations,
        "readback_mismatches": _readback(counts),
        "foreign_writes": counts.get("foreign_writes", 0),
        "ownership_violations": result.ownership_violations,
        "table_mismatches": counts.get("table_mismatches", 0),
        "kernel_mismatches": counts.get("kernel_mismatches", 0),
        "invariant_failures": result.invariant_failures,
        "sched_step_us_p50": result.sched_step_us(50),
        "sched_step_us_p99": result.sched_step_us(99),
        "sched_step_cpu_us_p50": result.sched_step_us(50, cpu=True),
        "sched_step_cpu_us_p99": result.sched_step_us(99, cpu=True),
        "preemptions": result.preemptions,
        "resumed": result.resumed,
        "prefix_hit_rate": result.prefix_hit_rate,
        "acceptance_rate": result.acceptance_rate,
        "mean_acceptance_length": result.mean_acceptance_length,
        "kv_usage_max": result.kv_usage_max,
        "kv_usage_mean": result.kv_usage_mean,
        "prompt_tokens": result.prompt_tokens,
        "computed_tokens": result.computed_tokens,
        "generated_tokens": result.generated_tokens,
        "slots_checked": result.slots_checked,
        "wall_s": result.wall_s,
        "error": result.error,
        "violations": [v.to_dict() for v in result.violations],
        "config": result.config,
        "verifier_counts": counts,
        "finish_reasons": result.finish_reasons,
        "draft_tokens_scheduled": result.draft_tokens_scheduled,
        "drafter_skipped_rows": result.drafter_skipped_rows,
        "kv_slots_written": result.kv_slots_written,
        "invariant_checks": result.invariant_checks,
        "first_invariant_failure": result.first_invariant_failure,
        "sched_s": result.sched_s,
        "scheduler_stats": result.scheduler_stats,
    }
    return doc


def write_json(result: SimResult, path: Union[str, Path]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(to_json(result), indent=2, sort_keys=False) + "\n")


def write_plot(result: SimResult, path: Union[str, Path]) -> None:
    """PNG: scheduler time per step, running/waiting requests, KV usage; violations marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = result.series
    steps = np.arange(len(series))
    fig = Figure(figsize=(10, 8), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_time, ax_reqs, ax_kv = fig.subplots(3, 1, sharex=True)
    cfg = result.config
    fig.suptitle(
        f"dflash-rs simulate: {cfg['method']} K={cfg['num_speculative_tokens']}, "
        f"{cfg['num_blocks']} blocks, lookahead {cfg['lookahead_policy']}, "
        f"{result.integrity_violations} integrity violations"
    )

    sched_us = np.asarray(series.sched_ns, dtype=float) / 1e3
    cpu_us = np.asarray(series.sched_cpu_ns, dtype=float) / 1e3
    ax_time.plot(steps, sched_us, lw=0.6, label="wall (perf_counter_ns)")
    ax_time.plot(steps, cpu_us, lw=0.6, alpha=0.7, label="thread CPU time")
    if len(sched_us):
        ax_time.axhline(np.median(sched_us), color="k", ls="--", lw=0.8, label="wall p50")
        ax_time.set_yscale("log")
    ax_time.set_ylabel("scheduler us / step")
    ax_time.legend(loc="upper right", fontsize=8)

    ax_reqs.plot(steps, series.num_running, label="running")
    ax_reqs.plot(steps, series.num_waiting, label="waiting")
    ax_reqs.set_ylabel("requests")
    ax_reqs.legend(loc="upper right", fontsize=8)

    ax_kv.plot(steps, 100 * np.asarray(series.kv_usage, dtype=float), color="tab:green")
    ax_kv.set_ylabel("KV usage %")
    ax_kv.set_ylim(0, 105)
    ax_kv.set_xlabel("step")
    bad = np.flatnonzero(np.asarray(series.violations) > 0)
    for ax in (ax_time, ax_reqs, ax_kv):
        for step in bad[:200]:
            ax.axvline(step, color="tab:red", alpha=0.25, lw=0.8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
