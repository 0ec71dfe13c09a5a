"""``dflash-rs bench``: per-step CPU cost of dflash-rs's Scheduler through Python, on the
workload of vLLM's scheduler anchor harness, optionally side by side with vLLM's scheduler.

Per simulated step: schedule(), the spec tokens of the step (``spec``), a fabricated model
output (not timed), update_from_output() (``update``), the drafts for the next step
(``drafts``) and admissions (``admit``); ``total`` = schedule + spec + update + drafts.
Modes: decode (N requests admitted at once, pure decode), serve (closed loop with N in
flight), preempt (serve at --preempt-n with --preempt-block-frac of the blocks), micro
(Request() + add_request() of one prompt). Paths: arrays (int32 arrays in and out, the
runner's own drafts counted by ``num_spec_tokens_array``), lists (the README's loop: sampled
lists in, every RequestOutput's request_id, new_token_ids and finish_reason read within
``update``, a drafts dict, the runner's own drafts as on the arrays path) and
lists_spec_dict (lists in and out, the drafts to verify read from
``scheduled_spec_decode_tokens`` as vLLM's engine does, only finished outputs read).

With ``--baseline-python PY`` (an interpreter where vLLM 0.33 is installed) the same workload
(same prompts, max_tokens, acceptance draws and drafts for each request) is replayed on vLLM's
V1 Scheduler by ``vllm_driver.py`` in that interpreter, and a table of both p50s with the
vLLM/ours ratios is printed (micro is not replayed there).

``--json PATH`` keys: what, versions, machine, args, total_wall_s, aggregate (one row per mode,
spec, n, path: ``<phase>_p50_us``, ``<phase>_p99_us``, ``<phase>_mean_us``, ``mean_<stat>``,
measured_steps, reps, ...), micro_aggregate, runs, micro_runs, baseline (null, or versions,
aggregate, runs, prompts_identical of vLLM) and comparison (rows of both p50s and ratios).
Exit status: 0, 1 when the baseline could not run, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from dflash_rs._cli_types import (
    HelpFormatter,
    check_or_exit,
    choice_list,
    float_in,
    int_at_least,
    int_list,
    non_negative_int,
    output_path,
    positive_float,
    positive_int,
    seed,
    speculative_tokens,
    string_pair,
)
from dflash_rs.bench import baseline as bl
from dflash_rs.bench.loop import (
    MICRO_SHORT_PROMPT_LEN,
    build_scheduler_config,
    micro_admit,
    run_sim,
)
from dflash_rs.bench.stats import aggregate, core_info, fmt_table, machine_info, median
from dflash_rs.bench.workload import prompt_hashes
from dflash_rs.config import SPECULATIVE_METHODS

__all__ = ["add_arguments", "check_args", "main", "run"]

MODES = ("decode", "serve", "preempt", "micro")
PATHS = ("arrays", "lists", "lists_spec_dict")
SPECS = ("none", *SPECULATIVE_METHODS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--n-reqs",
        type=int_list(1),
        default="64,256,1024",
        help="concurrency levels N (comma list)",
    )
    add(
        "--spec",
        "--method",
        dest="spec",
        type=choice_list(SPECS),
        default="dflash",
        help=f"speculative methods (comma list of {', '.join(SPECS)})",
    )
    add(
        "--modes",
        type=choice_list(MODES),
        default=",".join(MODES),
        help=f"comma list of {', '.join(MODES)}",
    )
    add(
        "--paths",
        type=choice_list(PATHS),
        default="arrays,lists",
        help=f"input paths (comma list of {', '.join(PATHS)})",
    )
    add(
        "-k",
        "--num-speculative-tokens",
        "--num-spec-tokens",
        dest="num_spec_tokens",
        type=speculative_tokens,
        default=8,
        help="K, drafts per step",
    )
    add("--accept", default="uniform", choices=["uniform", "all", "none"], help="accepted drafts")
    add("--seed", type=seed, default=0, help="workload seed (config seed = seed + 1000 N)")
    add("--reps", type=positive_int, default=3, help="repetitions (medians reported)")
    add("--warmup-steps", type=non_negative_int, default=20, help="steps before the timed window")
    add("--measure-steps", type=positive_int, default=150, help="timed steps per run")
    add("--max-sim-steps", type=positive_int, default=5000, help="steps per run at most")
    add("--block-size", type=positive_int, default=16, help="tokens per KV block")
    add("--max-num-batched-tokens", type=positive_int, default=16384, help="token budget per step")
    add("--max-num-seqs", type=positive_int, default=1024, help="raised to N when N is larger")
    add("--max-model-len", type=int_at_least(2), default=8192, help="context limit per request")
    add("--max-tokens", type=positive_int, default=256, help="serve-mode max_tokens (drawn from 1)")
    add("--decode-max-tokens", type=positive_int, default=2048, help="decode-mode max_tokens")
    add("--prefix-len", type=non_negative_int, default=512, help="shared prefix of even prompts")
    add("--min-prompt", type=positive_int, default=128, help="shortest prompt (tokens)")
    add("--max-prompt", type=positive_int, default=2048, help="longest prompt (tokens)")
    add("--preempt-n", type=non_negative_int, default=256, help="N of preempt mode (0: skip it)")
    add(
        "--preempt-block-frac",
        type=float_in(0.0, 1.0, low_open=True),
        default=0.25,
        help="preempt mode's fraction of the blocks that N requests need",
    )
    add("--micro-iters", type=positive_int, default=2000, help="admissions per micro rep")
    add("--micro-prompt-len", type=positive_int, default=1100, help="micro prompt length (tokens)")
    add("--micro-seed", type=seed, default=None, help="seed of the micro prompts (seed + rep)")
    add(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "blake3", "xxh3_128"],
        help="prefix-cache block hash (vLLM's default is sha256)",
    )
    add("--gc", default="engine", choices=["engine", "off"], help="engine: freeze heap, keep GC")
    add(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: perf_counter_ns; cpu: thread_time_ns (both sides)",
    )
    add(
        "--draw-order",
        default="vllm",
        choices=["vllm", "batch"],
        help="map per-position random draws to requests in vLLM's batch order (same tokens "
        "per request as vLLM) or use dflash-rs's batch order",
    )
    add(
        "--json",
        dest="json_out",
        type=output_path,
        default=None,
        metavar="PATH",
        help="write all results here",
    )
    add(
        "--baseline-python",
        default=None,
        metavar="PATH",
        help="Python interpreter with vLLM installed: replay the workload on vLLM's scheduler",
    )
    add("--baseline-timeout", type=positive_float, default=None, help="seconds for the vLLM run")
    add("--trace-out", type=output_path, default=None, help="JSONL, one line per simulated step")
    add("--check", action="store_true", help="cross-check draft bookkeeping and invariants")
    add(
        "--profile-out",
        type=output_path,
        default=None,
        help="cProfile the timed calls of the measured steps",
    )
    add(
        "--perf-ctl",
        type=string_pair,
        default=None,
        metavar="CTL,ACK",
        help="perf record control fifos",
    )
    add(
        "--dump-prompt-hashes",
        type=non_negative_int,
        default=0,
        metavar="COUNT",
        help="print sha256 of the first COUNT prompts per config seed and exit",
    )
    add("--quiet", action="store_true", help="print only the result tables")


def check_args(args: argparse.Namespace) -> None:
    """Options checked against each other and against the scheduler configs they build."""
    if args.min_prompt > args.max_prompt:
        raise ValueError(f"--min-prompt {args.min_prompt} is above --max-prompt {args.max_prompt}")
    longest = max(args.max_prompt, args.prefix_len + args.min_prompt)
    if longest > args.max_model_len:
        raise ValueError(
            f"prompts of up to {longest} tokens (--max-prompt, --prefix-len + --min-prompt) "
            f"exceed --max-model-len {args.max_model_len}"
        )
    micro_longest = max(args.micro_prompt_len, MICRO_SHORT_PROMPT_LEN)
    if "micro" in args.modes and micro_longest > args.max_model_len:
        raise ValueError(
            f"micro prompts of {MICRO_SHORT_PROMPT_LEN} and {args.micro_prompt_len} tokens "
            f"(--micro-prompt-len) exceed --max-model-len {args.max_model_len}"
        )
    for spec in args.spec:
        build_scheduler_config(args, spec, num_blocks=64, max_num_seqs=args.max_num_seqs)


def _with_parent(path: str) -> str:
    """``path``, once its folder exists (an output path may name folders not made yet)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return path


def _say(args: Any, msg: str) -> None:
    if not args.quiet:
        print(msg, flush=True)


def run(args: argparse.Namespace) -> int:
    n_list, spec_list, modes, paths = args.n_reqs, args.spec, args.modes, args.paths

    if args.dump_prompt_hashes:
        seeds = sorted(
            {args.seed + 1000 * n for n in n_list}
            | ({args.seed + 1000 * args.preempt_n} if args.preempt_n else set())
        )
        doc = {str(s): prompt_hashes(args, s, args.dump_prompt_hashes) for s in seeds}
        print(json.dumps(doc))
        return 0

    t_start = time.perf_counter()
    info = machine_info()
    versions = {"numpy": np.__version__, "python": platform.python_version(), **core_info()}
    _say(
        args,
        f"dflash_rs {versions['dflash_rs']} (core {versions.get('core_so_sha256')}, "
        f"{versions.get('core_so_mtime')})  numpy {np.__version__}  python "
        f"{platform.python_version()}",
    )

    configs = [
        (m, s, n) for m in modes if m in ("decode", "serve") for s in spec_list for n in n_list
    ]
    if "preempt" in modes and args.preempt_n > 0:
        configs += [("preempt", s, args.preempt_n) for s in spec_list]

    trace = open(_with_parent(args.trace_out), "w") if args.trace_out else None
    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
    runs: Dict[Any, List[Dict]] = {(*c, path): [] for c in configs for path in paths}
    micro_runs = []
    try:
        for rep in range(args.reps):
            for mode, spec, n in configs:
                for path in paths:
                    t0 = time.perf_counter()
                    r = run_sim(
                        args,
                        mode,
                        n,
                        spec,
                        seed=args.seed + 1000 * n,
                        path=path,
                        block_frac=args.preempt_block_frac if mode == "preempt" else 1.0,
                        trace=trace,
                        check=args.check,
                        profiler=profiler,
                    )
                    r["rep"] = rep
                    r["wall_s"] = time.perf_counter() - t0
                    runs[(mode, spec, n, path)].append(r)
                    t = r["timings"]
                    _say(
                        args,
                        f"rep {rep} {mode:7s} {spec:6s} N={n:5d} {path:6s}: total p50 "
                        f"{(t['total'] or {}).get('p50_us', float('nan')):8.1f}us  steps "
                        f"{r['measured_steps']} ({r['stop_reason']}), fill {r['fill_steps']}, "
                        f"preempt {r['preempted_total']}, wall {r['wall_s']:.1f}s",
                    )
            if "micro" in modes:
                mseed = args.seed + rep if args.micro_seed is None else args.micro_seed
                mr = micro_admit(args, mseed, args.micro_iters)
                micro_runs.append(mr)
                _say(
                    args,
                    f"rep {rep} micro: "
                    + ", ".join(
                        f"{k}={v['p50_us']:.2f}us" for k, v in mr.items() if k.startswith("admit_")
                    ),
                )
    finally:
        if trace:
            trace.close()

    rows = [
        (k, aggregate(v)) for k, v in runs.items() if v and all(r["timings"]["total"] for r in v)
    ]
    agg_rows = [{"mode": k[0], "spec": k[1], "n": k[2], "path": k[3], **a} for k, a in rows]
    micro_agg = {}
    for k, v in (micro_runs[0] if micro_runs else {}).items():
        if isinstance(v, dict):
            micro_agg[k] = {
                s: median([m[k][s] for m in micro_runs]) for s in ("p50_us", "p99_us", "mean_us")
            }
    print()
    print(
        f"dflash-rs Scheduler, CPU time per step through Python, microseconds, median over "
        f"{args.reps} reps of the p50/p99 of each rep's measured window"
    )
    if rows:
        print(fmt_table(rows))
    empty = [k for k, v in runs.items() if v and not all(r["timings"]["total"] for r in v)]
    for k in empty:
        print(f"no measured steps for {k} (raise --max-sim-steps or lower --warmup-steps)")
    if micro_agg:
        print(
            f"\nAdmission, Request() + add_request(), microseconds per request, median over "
            f"{len(micro_runs)} reps of {args.micro_iters} admissions:"
        )
        for k, v in micro_agg.items():
            print(
                f"  {k:28s} p50 {v['p50_us']:8.2f}  p99 {v['p99_us']:8.2f}  "
                f"mean {v['mean_us']:8.2f}"
            )
    if profiler is not None:
        import pstats

        profiler.dump_stats(_with_parent(args.profile_out))
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)

    status = 0
    base_doc: Optional[Dict[str, Any]] = None
    comparison: List[Dict[str, Any]] = []
    if args.baseline_python and configs:
        _say(args, f"\nreplaying on vLLM's scheduler under {args.baseline_python} ...")
        try:
            doc = bl.run_driver(
                args.baseline_python, bl.build_spec(args, configs), args.baseline_timeout
            )
        except (OSError, RuntimeError, ValueError) as e:
            print(f"dflash-rs bench: baseline failed: {e}", file=sys.stderr)
            status = 1
        else:
            v_agg = bl.aggregate(doc["runs"])
            same = bl.prompts_identical(args, doc)
            base_doc = {
                "python": args.baseline_python,
                "versions": doc["versions"],
                "import_s": doc["import_s"],
                "prompts_identical": same,
                "aggregate": v_agg,
                "runs": doc["runs"],
            }
            comparison = bl.compare(agg_rows, v_agg)
            ver = doc["versions"]
            print(
                f"\nvLLM {ver['vllm']} (torch {ver['torch']}, python {ver['python']}) vs "
                f"dflash-rs {versions['dflash_rs']}: p50 microseconds per step, x = vLLM/ours; "
                f"prompts {'identical' if same else 'DIFFERENT'} (sha256)"
            )
            print(bl.fmt_compare(comparison))
            print(
                "vLLM's total = schedule + get_grammar_bitmask + update + drafts; ours = "
                "schedule + spec + update + drafts."
            )
    elif args.baseline_python:
        print(
            "dflash-rs bench: --baseline-python replays decode/serve/preempt only", file=sys.stderr
        )

    total_s = time.perf_counter() - t_start
    _say(args, f"\ntotal wall time {total_s:.1f}s")
    try:
        info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    if args.json_out:
        doc = {
            "what": "dflash-rs Scheduler CPU cost per step through Python (offline, fabricated "
            "model outputs, workload of the vLLM anchor harness)",
            "versions": versions,
            "machine": info,
            "args": {k: v for k, v in vars(args).items() if k != "run"},
            "total_wall_s": total_s,
            "aggregate": agg_rows,
            "micro_aggregate": micro_agg,
            "runs": [r for v in runs.values() for r in v],
            "micro_runs": micro_runs,
            "baseline": base_doc,
            "comparison": comparison,
        }
        with open(_with_parent(args.json_out), "w") as f:
            json.dump(doc, f, indent=1)
        _say(args, f"wrote {args.json_out}")
    return status


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Stand-alone entry point (``benches/scheduler_bench.py``)."""
    parser = argparse.ArgumentParser(
        prog="scheduler_bench", description=__doc__, formatter_class=HelpFormatter
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    check_or_exit(parser, check_args, args)
    return run(args)
