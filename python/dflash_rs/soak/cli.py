"""``dflash-rs soak``: push many requests through the scheduler alone, under memory pressure.

No KV tensor and no kernel: a fake model samples tokens with random draft acceptance, so a
million requests take minutes, not days. Requests have short random prompts (often sharing a
prefix, so the prefix cache hits), small ``max_tokens``, and a few percent are aborted, some
while their step is in flight. The pool is small, so requests are preempted and resumed.

Checked: every step, the block table against the ownership contract with numpy (each row's
query window, lookahead included, lies in its owned columns; no null, stale or foreign ids;
lookahead blocks are private); every ``--check-every`` steps, ``check_invariants()`` and each
row against ``block_ids()``. At the end every request must have finished and been reported
once, and the pool must be whole (no leaked block). RSS is sampled along the way; the run fails
if it grows by ``--max-rss-growth`` percent or more between warm-up and the end.

Exit status: 0 when nothing leaked, nothing was violated and RSS stayed flat; 1 otherwise;
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Tuple

from dflash_rs._cli_types import (
    int_at_least,
    non_negative_float,
    output_path,
    positive_int,
    probability,
    seed,
    speculative_tokens,
)
from dflash_rs.soak.config import METHODS, SoakConfig
from dflash_rs.soak.report import SoakReport
from dflash_rs.soak.runner import Progress, run_soak

__all__ = ["add_arguments", "check_args", "config_from_args", "run"]

_DEFAULTS = SoakConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add(
        "--num-requests", type=positive_int, default=d.num_requests, help="requests to push through"
    )
    add(
        "--num-blocks",
        type=int_at_least(2),
        default=d.num_blocks,
        help="KV blocks (small = preemption)",
    )
    add("--block-size", type=positive_int, default=d.block_size, help="tokens per KV block")
    add(
        "--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="running requests at most"
    )
    add("--method", choices=METHODS, default=d.method, help="speculative method")
    add(
        "-k",
        "--num-speculative-tokens",
        type=speculative_tokens,
        default=d.num_speculative_tokens,
        help="K, drafts per step",
    )
    add("--policy", choices=("fcfs", "priority"), default=d.policy, help="scheduling policy")
    add("--seed", type=seed, default=d.seed, help="workload and sampler seed")
    add(
        "--abort-rate",
        type=probability,
        default=d.abort_rate,
        help="fraction of requests marked to be aborted (if still live by then)",
    )
    add(
        "--check-every",
        type=positive_int,
        default=d.check_every,
        help="full check (check_invariants + block_ids per row) every N steps; the numpy "
        "ownership check runs every step",
    )
    add(
        "--max-rss-growth",
        type=non_negative_float,
        default=d.max_rss_growth_pct,
        help="fail when RSS grows by this many percent from warm-up to the end",
    )
    add(
        "--lookahead-policy",
        choices=("correct", "legacy-first-prefill", "legacy-k"),
        default=d.lookahead_policy,
        help=argparse.SUPPRESS,
    )
    add(
        "--trace-python-heap",
        action="store_true",
        help="also measure the Python heap with tracemalloc (slower), to tell Python from "
        "native growth",
    )
    add("--json", type=output_path, metavar="PATH", help="write the report as JSON")
    add("--quiet", action="store_true", help="no progress bar or summary, only the verdict")


def check_args(args: argparse.Namespace) -> None:
    """Options checked against each other: the run's config must build."""
    config_from_args(args)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(
        num_requests=args.num_requests,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        method=args.method,
        num_speculative_tokens=args.num_speculative_tokens,
        policy=args.policy,
        seed=args.seed,
        abort_rate=args.abort_rate,
        check_every=args.check_every,
        max_rss_growth_pct=args.max_rss_growth,
        lookahead_policy=args.lookahead_policy,
        trace_python_heap=args.trace_python_heap,
    )


def _progress_bar(total: int) -> Tuple[Any, Optional[Progress]]:
    """A tqdm bar when tqdm is installed (the 'sim' extra), else none."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None, None
    bar = tqdm(total=total, unit="req", desc="soak", dynamic_ncols=True)
    seen = [0]

    def update(_: int, report: SoakReport) -> None:
        if report.steps % 200:
            return
        bar.update(report.requests_finished - seen[0])
        seen[0] = report.requests_finished
        rss = report.rss_samples[-1][1] / 2**20 if report.rss_samples else 0.0
        bar.set_postfix(step=report.steps, rss=f"{rss:.0f}MiB", bad=report.violations)

    return bar, update


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # check_args passed
    show_progress = not args.quiet and sys.stderr.isatty()
    bar, progress = _progress_bar(config.num_requests) if show_progress else (None, None)
    try:
        report = run_soak(config, progress)
    finally:
        if bar is not None:
            bar.close()
    text = report.summary()
    print(text if not args.quiet else text.splitlines()[-1])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        if not args.quiet:
            print(f"wrote {args.json}")
    return 0 if report.ok else 1
