"""Time the DFlash input-expansion kernel on one GPU, next to a vLLM-layout baseline.

Variants, each launched into preallocated buffers:
  empty          a trivial Triton kernel (one program, no work): the launch floor
  vllm-layout    vLLM's per-(request x token tile) layout, re-implemented from the semantics of
                 vLLM's copy_and_expand_dflash_inputs_kernel (default mode only)
  default        dflash_rs.kernels, default (vLLM-compatible) mode
  strict         dflash_rs.kernels, strict mode (num_blocks_per_row, max_model_len), with the
                 exact per-launch violation count (per-program slots, summed when read)
  strict-acc     strict mode with accumulate_violations=True

Each variant is first checked against the pure-torch reference on the GPU, then timed two ways:
``triton.testing.do_bench`` (one launch per call, so it includes the Python launch cost) and
inside a CUDA graph (N launches captured, replayed R times, time / (N*R)): the per-launch cost a
serving engine sees. The graph samples of a workload's variants are taken in turn, after a
warm-up, so that clock drift shifts all of them alike. Prints a markdown table; ``--json PATH``
also writes the numbers.

    python benches/gpu/bench_expand.py --json bench_expand.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs
from dflash_rs.kernels._validate import ExpandArgs, prepare_expand_args
from dflash_rs.kernels.dflash_expand import launch_expand_kernel
from dflash_rs.kernels.result import LANE_BUFFERS

NUM_SPEC = 8
BLOCK = 16
MAX_MODEL_LEN = 8192
MASK_TOKEN_ID = 151_000
TABLE_ROWS = 1024  # the persistent table; batches use a row slice, like vLLM
OUTPUT_FIELDS = LANE_BUFFERS


# --------------------------------------------------------------------------------------------
# Baselines


@triton.jit
def _empty_kernel(ptr):
    pass


@triton.jit
def _vllm_layout_kernel(
    next_token_ids_ptr,
    target_positions_ptr,
    query_start_loc_ptr,
    block_table_ptr,
    num_rejected_ptr,
    input_ids_ptr,
    context_positions_ptr,
    query_positions_ptr,
    context_slots_ptr,
    query_slots_ptr,
    token_indices_ptr,
    mask_token_id,
    block_size,
    num_query,
    num_spec,
    num_ctx,
    table_stride,
    TILE: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
):
    """One program per (request, lane tile); scalars are runtime values, as in section 4.3."""
    row = tl.program_id(0)
    lanes = tl.program_id(1) * TILE + tl.arange(0, TILE)
    start = tl.load(query_start_loc_ptr + row)
    end = tl.load(query_start_loc_ptr + row + 1)
    context_len = end - start
    in_bounds = lanes < context_len + num_query
    is_context = lanes < context_len
    is_query = in_bounds & (lanes >= context_len)
    query_index = lanes - context_len
    context_position = tl.load(
        target_positions_ptr + tl.minimum(start + lanes, num_ctx - 1), mask=is_context, other=0
    )
    valid_end = end
    if HAS_REJECTED:
        valid_end = end - tl.load(num_rejected_ptr + row)
    last = tl.load(target_positions_ptr + valid_end - 1)
    positions = tl.where(is_context, context_position, last + 1 + query_index)
    column = tl.minimum(positions // block_size, table_stride - 1)
    block_id = tl.load(block_table_ptr + row * table_stride + column, mask=in_bounds, other=0)
    slots = block_id.to(tl.int64) * block_size + positions % block_size
    tl.store(context_positions_ptr + start + lanes, positions, mask=is_context)
    tl.store(context_slots_ptr + start + lanes, slots, mask=is_context)
    query_lane = row * num_query + query_index
    tl.store(query_positions_ptr + query_lane, positions, mask=is_query)
    tl.store(query_slots_ptr + query_lane, slots, mask=is_query)
    bonus = tl.load(next_token_ids_ptr + row)
    tl.store(
        input_ids_ptr + query_lane,
        tl.where(query_index == 0, bonus, mask_token_id),
        mask=is_query,
    )
    tl.store(
        token_indices_ptr + row * num_spec + query_index - 1,
        query_lane,
        mask=is_query & (query_index >= 1),
    )


def launch_vllm_layout(args: ExpandArgs, max_context_len: int) -> None:
    """Grid (num_reqs, cdiv(max_query_len + K + 1, TILE)), TILE = min(256, next_pow2(...))."""
    out = args.out
    num_query = args.num_speculative_tokens + 1
    per_request = max_context_len + num_query
    tile = min(256, triton.next_power_of_2(per_request))
    grid = (args.num_reqs, triton.cdiv(per_request, tile))
    rejected = args.num_rejected_tokens
    _vllm_layout_kernel[grid](
        args.next_token_ids,
        args.target_positions,
        args.query_start_loc,
        args.block_table,
        rejected if rejected is not None else args.next_token_ids,
        out.input_ids,
        out.context_positions,
        out.query_positions,
        out.context_slot_mapping,
        out.query_slot_mapping,
        out.token_indices_to_sample,
        args.mask_token_id,
        args.block_size,
        num_query,
        args.num_speculative_tokens,
        args.num_ctx,
        args.block_table.stride(0),
        TILE=tile,
        HAS_REJECTED=rejected is not None,
    )


# --------------------------------------------------------------------------------------------
# Workloads


@dataclass
class Workload:
    name: str
    context_lens: list[int]
    first_positions: list[int]  # position of each request's first context token

    @property
    def num_reqs(self) -> int:
        return len(self.context_lens)

    @property
    def num_ctx(self) -> int:
        return sum(self.context_lens)


def make_workloads(generator: torch.Generator) -> list[Workload]:
    def decode(n: int) -> Workload:
        starts = torch.randint(0, 4000, (n,), generator=generator).tolist()
        return Workload(f"decode {n}x{NUM_SPEC + 1}", [NUM_SPEC + 1] * n, starts)

    workloads = [decode(n) for n in (1, 8, 64, 256, 512, 1024)]
    ragged = torch.randint(1, NUM_SPEC + 2, (1024,), generator=generator).tolist()
    starts = torch.randint(0, 4000, (1024,), generator=generator).tolist()
    workloads.append(Workload("decode 1024 ragged 1..9", ragged, starts))
    workloads.append(Workload("prefill 4x2048", [2048] * 4, [0] * 4))
    workloads.append(Workload("prefill 64x512", [512] * 64, [0] * 64))
    mixed_starts = [0, *torch.randint(0, 4000, (255,), generator=generator).tolist()]
    workloads.append(Workload("mixed 1x2048 + 255x9", [2048] + [9] * 255, mixed_starts))
    return workloads


@dataclass
class Inputs:
    workload: Workload
    tensors: dict[str, torch.Tensor]
    max_context_len: int


def build_inputs(workload: Workload, generator: torch.Generator, device: str = "cuda") -> Inputs:
    """Positions, a fully allocated block table (row slice of a persistent one), rejections."""
    lens = torch.tensor(workload.context_lens)
    starts = torch.tensor(workload.first_positions)
    qsl = torch.zeros(workload.num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(lens, 0)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lens.tolist())])
    is_decode = all(n <= NUM_SPEC + 1 for n in workload.context_lens)
    rejected = torch.zeros(workload.num_reqs, dtype=torch.int32)
    if is_decode:
        rejected = torch.minimum(
            torch.randint(0, NUM_SPEC + 1, (workload.num_reqs,), generator=generator), lens - 1
        ).to(torch.int32)
    width = triton.cdiv(MAX_MODEL_LEN, BLOCK)
    table = torch.randint(1, 100_000, (TABLE_ROWS, width), generator=generator, dtype=torch.int32)
    needed = (starts + lens + NUM_SPEC + 1 + BLOCK - 1) // BLOCK  # blocks incl. the K+1 window
    return Inputs(
        workload,
        {
            "next_token_ids": torch.randint(
                0, 150_000, (workload.num_reqs,), generator=generator, dtype=torch.int32
            ).to(device),
            "target_positions": positions.to(device),
            "query_start_loc": qsl.to(device),
            "block_table": table.to(device)[: workload.num_reqs],
            "num_rejected_tokens": rejected.to(device),
            "num_blocks_per_row": needed.to(torch.int32).to(device),
        },
        max_context_len=int(lens.max()),
    )


def prepare(
    inputs: Inputs, strict: bool, out: DFlashInputs, accumulate: bool = False
) -> ExpandArgs:
    t = inputs.tensors
    return prepare_expand_args(
        t["next_token_ids"],
        t["target_positions"],
        t["query_start_loc"],
        t["block_table"],
        block_size=BLOCK,
        num_speculative_tokens=NUM_SPEC,
        mask_token_id=MASK_TOKEN_ID,
        num_rejected_tokens=t["num_rejected_tokens"],
        num_blocks_per_row=t["num_blocks_per_row"] if strict else None,
        max_model_len=MAX_MODEL_LEN if strict else None,
        out=out,
        validate=True,
        accumulate_violations=accumulate,
    )


# --------------------------------------------------------------------------------------------
# Correctness and timing


def reference_outputs(inputs: Inputs, strict: bool) -> DFlashInputs:
    t = inputs.tensors
    return expand_dflash_inputs(
        t["next_token_ids"],
        t["target_positions"],
        t["query_start_loc"],
        t["block_table"],
        block_size=BLOCK,
        num_speculative_tokens=NUM_SPEC,
        mask_token_id=MASK_TOKEN_ID,
        num_rejected_tokens=t["num_rejected_tokens"],
        num_blocks_per_row=t["num_blocks_per_row"] if strict else None,
        max_model_len=MAX_MODEL_LEN if strict else None,
        backend="reference",
    )


def check(name: str, got: DFlashInputs, want: DFlashInputs, with_violations: bool) -> list[str]:
    errors = []
    fields = OUTPUT_FIELDS + (("num_violations",) if with_violations else ())
    for field in fields:
        if not torch.equal(getattr(got, field), getattr(want, field)):
            errors.append(f"{name}: {field} differs from the reference")
    return errors


def capture_graph(launch: Callable[[], None], launches: int) -> torch.cuda.CUDAGraph:
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, launches: int, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / (launches * replays)


def graph_times_us(
    launches: dict[str, Callable[[], None]], per_graph: int, replays: int, repeats: int
) -> dict[str, float]:
    """Per-launch time of each variant: a graph of ``per_graph`` launches each, replayed
    ``replays`` times per sample; the samples of all variants are taken in turn (``repeats``
    rounds), so a drift of the GPU's clocks during the run shifts every variant alike. Median."""
    graphs = {name: capture_graph(launch, per_graph) for name, launch in launches.items()}
    samples: dict[str, list[float]] = {name: [] for name in launches}
    for _ in range(repeats):
        for name, graph in graphs.items():
            samples[name].append(replay_us(graph, per_graph, replays))
    return {name: statistics.median(values) for name, values in samples.items()}


def graph_time_us(launch: Callable[[], None], launches: int, replays: int, repeats: int) -> float:
    """Median over ``repeats`` of (replay time of a graph of ``launches`` launches) / launches."""
    return graph_times_us({"one": launch}, launches, replays, repeats)["one"]


def warm_up(launch: Callable[[], None], seconds: float) -> None:
    """Replay launches for ``seconds``: the GPU reaches its steady clocks before any sample."""
    graph = capture_graph(launch, 100)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(50):
            graph.replay()
        torch.cuda.synchronize()


def bench_us(launch: Callable[[], None]) -> float:
    return float(triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median")) * 1000


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    generator = torch.Generator().manual_seed(args.seed)
    workloads = make_workloads(generator)
    if args.only:
        workloads = [w for w in workloads if any(key in w.name for key in args.only)]
    empty_target = torch.zeros(1, dtype=torch.int32, device="cuda")

    def empty_launch() -> None:
        _empty_kernel[(1,)](empty_target)

    warm_up(empty_launch, args.warmup_s)

    rows, failures = [], []
    for workload in workloads:
        inputs = build_inputs(workload, generator)
        n, c = workload.num_reqs, workload.num_ctx
        names = ("vllm", "def", "strict", "acc")
        outs = {v: DFlashInputs.empty(n, c, NUM_SPEC, "cuda") for v in names}
        default_args = prepare(inputs, strict=False, out=outs["def"])
        strict_args = prepare(inputs, strict=True, out=outs["strict"])
        accumulate_args = prepare(inputs, strict=True, out=outs["acc"], accumulate=True)
        vllm_args = prepare(inputs, strict=False, out=outs["vllm"])
        launches: dict[str, Callable[[], None]] = {
            "empty": empty_launch,
            "vllm-layout": lambda a=vllm_args, m=inputs.max_context_len: launch_vllm_layout(a, m),
            "default": lambda a=default_args: launch_expand_kernel(a),
            "strict": lambda a=strict_args: launch_expand_kernel(a),
            "strict-acc": lambda a=accumulate_args: launch_expand_kernel(a),
        }
        # Correctness first, against the pure-torch reference on the same GPU.
        for launch in launches.values():
            launch()
        torch.cuda.synchronize()
        want_default = reference_outputs(inputs, strict=False)
        want_strict = reference_outputs(inputs, strict=True)
        failures += check(f"{workload.name} vllm-layout", outs["vllm"], want_default, False)
        failures += check(f"{workload.name} default", outs["def"], want_default, True)
        failures += check(f"{workload.name} strict", outs["strict"], want_strict, True)
        # Fully allocated tables: the accumulated count must stay 0 as well.
        failures += check(f"{workload.name} strict-acc", outs["acc"], want_strict, True)
        row: dict = {"workload": workload.name, "num_reqs": n, "num_ctx": c}
        times = graph_times_us(launches, args.graph_launches, args.graph_replays, args.repeats)
        for variant, launch in launches.items():
            row[f"{variant}_graph_us"] = times[variant]
            if not args.skip_do_bench:
                row[f"{variant}_do_bench_us"] = bench_us(launch)
        rows.append(row)
        print(f"  {workload.name}: done", file=sys.stderr)

    print_tables(rows, with_do_bench=not args.skip_do_bench)
    if failures:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
    if args.json:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "num_speculative_tokens": NUM_SPEC,
            "block_size": BLOCK,
            "graph_launches": args.graph_launches,
            "graph_replays": args.graph_replays,
            "repeats": args.repeats,
            "warmup_s": args.warmup_s,
            "correct": not failures,
            "failures": failures,
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 1 if failures else 0


def print_tables(rows: list[dict], with_do_bench: bool) -> None:
    variants = ("empty", "vllm-layout", "default", "strict", "strict-acc")

    def table(suffix: str, title: str) -> None:
        print(f"\n### {title}\n")
        header = "| workload | reqs | ctx | " + " | ".join(variants)
        print(header + " | default / vllm | strict / default | strict-acc / default |")
        print("|---|---:|---:|" + "---:|" * (len(variants) + 3))
        for row in rows:
            values = [row[f"{v}_{suffix}"] for v in variants]
            ratio = row[f"default_{suffix}"] / row[f"vllm-layout_{suffix}"]
            strict_cost = row[f"strict_{suffix}"] / row[f"default_{suffix}"]
            accumulate_cost = row[f"strict-acc_{suffix}"] / row[f"default_{suffix}"]
            cells = " | ".join(f"{v:.2f}" for v in values)
            print(
                f"| {row['workload']} | {row['num_reqs']} | {row['num_ctx']} | {cells} | "
                f"{ratio:.2f}x | {strict_cost:.2f}x | {accumulate_cost:.2f}x |"
            )

    table("graph_us", "Per launch inside a CUDA graph (us, median)")
    if with_do_bench:
        table("do_bench_us", "triton.testing.do_bench, one launch per call (us, median)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--graph-launches", type=int, default=100, help="launches per graph")
    parser.add_argument("--graph-replays", type=int, default=50, help="replays per sample")
    parser.add_argument("--repeats", type=int, default=7, help="samples per measurement")
    parser.add_argument(
        "--warmup-s", type=float, default=2.0, help="seconds of launches before the first sample"
    )
    parser.add_argument("--skip-do-bench", action="store_true", help="CUDA-graph timing only")
    parser.add_argument("--only", nargs="*", help="run workloads whose name contains these")
    parser.add_argument("--seed", type=int, default=0)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
