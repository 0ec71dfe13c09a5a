"""``dflash-rs simulate``: a serving simulation that proves KV integrity on a real paged KV
cache. Exit status: 0 when every check passed, 1 on any violation, 2 on bad arguments."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from dflash_rs._cli_types import (
    int_at_least,
    non_negative_float,
    output_path,
    positive_int,
    probability,
    seed,
    speculative_tokens,
)
from dflash_rs.sim.config import KERNEL_BACKENDS, METHODS, SimConfig

if TYPE_CHECKING:
    from dflash_rs.sim.metrics import SimResult

__all__ = ["add_arguments", "check_args", "config_from_args", "run"]

_DEFAULTS = SimConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    add = parser.add_argument
    add("--seed", type=seed, default=d.seed, help="workload and sampler seed")
    add(
        "--num-requests",
        type=positive_int,
        default=d.num_requests,
        help="requests, all turns counted",
    )
    add(
        "--num-blocks",
        type=int_at_least(2),
        default=d.num_blocks,
        help="KV blocks (small = preemptions)",
    )
    add("--block-size", type=positive_int, default=d.block_size, help="tokens per KV block")
    add("--method", choices=METHODS, default=d.method, help="speculative method")
    add(
        "-k",
        "--num-speculative-tokens",
        type=speculative_tokens,
        default=d.num_speculative_tokens,
        help="K, drafts per step",
    )
    add(
        "--acceptance-rate",
        type=probability,
        default=d.acceptance_rate,
        help="probability that a draft is accepted given the earlier ones were",
    )
    add(
        "--arrival-rate",
        type=non_negative_float,
        default=d.arrival_rate,
        help="first-turn arrivals per model step (Poisson); 0 = all at once",
    )
    add(
        "--max-model-len",
        type=int_at_least(2),
        default=d.max_model_len,
        help="context limit per request",
    )
    add(
        "--max-num-seqs", type=positive_int, default=d.max_num_seqs, help="running requests at most"
    )
    add(
        "--max-num-batched-tokens",
        type=positive_int,
        default=d.max_num_batched_tokens,
        help="token budget per step (chunked prefill)",
    )
    add("--policy", choices=("fcfs", "priority"), default=d.policy, help="scheduling policy")
    add(
        "--kernel",
        choices=KERNEL_BACKENDS,
        default=d.kernel,
        help="DFlash expansion backend; auto = Triton on CUDA (or under TRITON_INTERPRET=1), "
        "else the torch reference",
    )
    add(
        "--lookahead-policy",
        choices=("correct", "legacy-first-prefill", "legacy-k"),
        default=d.lookahead_policy,
        help="legacy values reproduce known lookahead bugs (the run must then fail)",
    )
    add("--no-prefix-caching", action="store_true", help="disable prefix caching")
    add("--max-steps", type=positive_int, default=d.max_steps, help=argparse.SUPPRESS)
    add("--json", type=output_path, metavar="PATH", help="write the report as JSON")
    add(
        "--plot",
        type=output_path,
        metavar="PATH",
        help="write a PNG of scheduler time, requests and KV usage",
    )
    add("--quiet", action="store_true", help="no progress bar or summary, only the verdict")


def check_args(args: argparse.Namespace) -> None:
    """Options checked against each other: the run's config must build."""
    config_from_args(args)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        seed=args.seed,
        num_requests=args.num_requests,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        method=args.method,
        num_speculative_tokens=args.num_speculative_tokens,
        acceptance_rate=args.acceptance_rate,
        arrival_rate=args.arrival_rate,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        policy=args.policy,
        kernel=args.kernel,
        lookahead_policy=args.lookahead_policy,
        enable_prefix_caching=not args.no_prefix_caching,
        max_steps=args.max_steps,
    )


def _progress_bar(total: int) -> tuple[Any, Callable[[int, SimResult], None]]:
    from tqdm import tqdm  # type: ignore[import-untyped]

    bar = tqdm(total=total, unit="req", desc="simulate", dynamic_ncols=True)

    def update(finished: int, result: SimResult) -> None:
        if finished:
            bar.update(finished)
        if result.steps % 16 == 0:
            series = result.series
            bar.set_postfix(
                step=result.steps,
                running=series.num_running[-1] if series.num_running else 0,
                waiting=series.num_waiting[-1] if series.num_waiting else 0,
                kv=f"{series.kv_usage[-1]:.0%}" if series.kv_usage else "-",
                bad=sum(series.violations),
                refresh=False,
            )

    return bar, update


def _prepare_kernel(kernel: str) -> None:
    """``--kernel triton`` without a GPU runs Triton's interpreter (slow, but real)."""
    if kernel != "triton" or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        os.environ["TRITON_INTERPRET"] = "1"
        print("no CUDA device: running the Triton kernel under TRITON_INTERPRET=1", file=sys.stderr)


def _optional_modules(args: argparse.Namespace, show_progress: bool) -> list[str]:
    """The optional modules (the 'sim' extra) this run's options use, imported before it starts."""
    needed = []
    if args.plot:
        needed.append("matplotlib.backends.backend_agg")
    if show_progress:
        needed.append("tqdm")
    return needed


def run(args: argparse.Namespace) -> int:
    show_progress = not args.quiet and sys.stdout.isatty()
    try:  # torch, triton, matplotlib and tqdm are optional extras: all checked before the run
        from dflash_rs.sim.engine import run_simulation
        from dflash_rs.sim.report import summary, write_json, write_plot

        for name in _optional_modules(args, show_progress):
            importlib.import_module(name)
    except ImportError as exc:
        missing = (exc.name or str(exc)).partition(".")[0]
        print(
            f"dflash-rs simulate needs the 'sim' extra ({missing} is missing): "
            "pip install 'dflash-rs[sim]'",
            file=sys.stderr,
        )
        return 2

    config = config_from_args(args)  # check_args passed
    _prepare_kernel(config.kernel)
    bar, progress = _progress_bar(config.num_requests) if show_progress else (None, None)
    try:
        result = run_simulation(config, progress=progress)
    finally:
        if bar is not None:
            bar.close()
    text = summary(result)
    print(text if not args.quiet else text.splitlines()[-1])
    if args.json:
        write_json(result, args.json)
    if args.plot:
        write_plot(result, args.plot)
    if not args.quiet and (args.json or args.plot):
        written = [p for p in (args.json, args.plot) if p]
        print(f"wrote {', '.join(written)}")
    return 0 if result.ok else 1
