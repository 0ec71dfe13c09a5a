"""Time launch-geometry and row-lookup variants of the DFlash expansion kernel on one GPU.

Each variant patches the module constants that ``launch_expand_kernel`` reads (tile sizes, warps,
row-lookup mode, window size), checks default and strict mode against the torch reference, then
times both inside a CUDA graph as ``bench_expand.py`` does, the variants' samples taken in turn.
It is the tool the kernel's constants were chosen with; ``bench_expand.py`` reports the chosen
configuration. Last, a latency ladder: a kernel of the grid of 1024 decode requests whose lanes
do 0..4 dependent loads, the floor under any layout that needs that many.

    python benches/gpu/sweep_expand.py --json sweep_expand.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from typing import Iterator, Optional

import bench_expand as bench
import torch
import triton
import triton.language as tl

from dflash_rs.kernels import DFlashInputs, _grid
from dflash_rs.kernels import dflash_expand as kernel
from dflash_rs.kernels.dflash_expand import launch_expand_kernel

# name -> constants to patch (module, attribute, value)
VARIANTS: dict[str, dict[str, int]] = {
    "chosen": {},
    "probe-first": {"PROBE_SPAN": -1},
    "window-64": {"WINDOW_MARGIN": 64},  # always the largest window
    "window-32": {"MAX_WINDOW": 32},
    "tile-256-w8": {"QUERY_TILE": 256, "CONTEXT_TILE": 256, "NUM_WARPS": 8},
    "chosen-again": {},  # the spread between two runs of one configuration
}
CHAIN_PROGRAMS = 144  # the grid of 1024 decode requests (K=8): 72 query + 72 context tiles
CHAIN_LANES = 128


@triton.jit
def _chain_kernel(table_ptr, out_ptr, DEPTH: tl.constexpr, LANES: tl.constexpr):
    """DEPTH dependent loads per lane (each address is the previous value), then one store."""
    lanes = tl.program_id(0) * LANES + tl.arange(0, LANES)
    value = lanes
    for _ in tl.static_range(DEPTH):
        value = tl.load(table_ptr + value)
    tl.store(out_ptr + lanes, value)


def chain_ladder(args: argparse.Namespace) -> dict[int, float]:
    """Per-launch time of a 144-program kernel with 0..4 dependent loads: the latency floor of
    a launch whose lanes need that many dependent loads (the query lanes need three)."""
    size = CHAIN_PROGRAMS * CHAIN_LANES
    table = torch.randperm(size, device="cuda").to(torch.int32)
    out = torch.empty(size, dtype=torch.int32, device="cuda")
    times = {}
    for depth in range(5):

        def launch(d: int = depth) -> None:
            _chain_kernel[(CHAIN_PROGRAMS,)](table, out, DEPTH=d, LANES=CHAIN_LANES)

        times[depth] = bench.graph_time_us(
            launch, args.graph_launches, args.graph_replays, args.repeats
        )
    return times


WORKLOADS = ("decode 8x9", "decode 1024x9", "decode 1024 ragged", "prefill 64x512", "mixed")


@contextlib.contextmanager
def patched(values: dict[str, int]) -> Iterator[None]:
    saved = []
    for name, value in values.items():
        module = _grid if hasattr(_grid, name) else kernel
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def run(args: argparse.Namespace) -> int:
    generator = torch.Generator().manual_seed(args.seed)
    workloads = [
        w for w in bench.make_workloads(generator) if any(key in w.name for key in WORKLOADS)
    ]
    inputs = [bench.build_inputs(w, generator) for w in workloads]
    bench.warm_up(lambda: bench._empty_kernel[(1,)](inputs[0].tensors["query_start_loc"]), 2.0)
    rows = {
        (v, item.workload.name): {"variant": v, "workload": item.workload.name}
        for v in VARIANTS
        for item in inputs
    }
    failures = []
    for item in inputs:
        n, c = item.workload.num_reqs, item.workload.num_ctx
        for mode, strict in (("default", False), ("strict", True)):
            # Capture every variant's graph under its constants, then sample them in turn.
            graphs, keep = {}, []
            for variant, values in VARIANTS.items():
                with patched(values):
                    out = DFlashInputs.empty(n, c, bench.NUM_SPEC, "cuda")
                    launch_args = bench.prepare(item, strict=strict, out=out)
                    launch_expand_kernel(launch_args)
                    torch.cuda.synchronize()
                    want = bench.reference_outputs(item, strict=strict)
                    name = f"{variant} {item.workload.name} {mode}"
                    failures += bench.check(name, out, want, True)
                    graphs[variant] = bench.capture_graph(
                        lambda a=launch_args: launch_expand_kernel(a), args.graph_launches
                    )
                    keep.append(out)
            samples: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
            for _ in range(args.repeats):
                for variant, graph in graphs.items():
                    samples[variant].append(
                        bench.replay_us(graph, args.graph_launches, args.graph_replays)
                    )
            for variant, values in samples.items():
                rows[(variant, item.workload.name)][mode] = statistics.median(values)
        print(f"  {item.workload.name}: done", file=sys.stderr)
    rows = list(rows.values())

    print("\n| variant | " + " | ".join(f"{w.name} def / strict" for w in workloads) + " |")
    print("|---|" + "---:|" * len(workloads))
    for variant in VARIANTS:
        cells = [f"{r['default']:.2f} / {r['strict']:.2f}" for r in rows if r["variant"] == variant]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    ladder = chain_ladder(args)
    print(
        "\n| dependent loads per lane (144 programs x 128 lanes) | " + " | ".join(map(str, ladder))
    )
    print("|---|" + "---:|" * len(ladder))
    print("| per launch in a CUDA graph (us) | " + " | ".join(f"{t:.2f}" for t in ladder.values()))
    if failures:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
    if args.json:
        with open(args.json, "w") as handle:
            report = {"variants": VARIANTS, "rows": rows, "chain_us": ladder, "failures": failures}
            json.dump(report, handle, indent=2)
    return 1 if failures else 0


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--graph-launches", type=int, default=100)
    parser.add_argument("--graph-replays", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
