"""Host time of one eager launch of the DFlash expansion, next to vLLM's kernel behind its launcher.

An engine that prepares the drafter's inputs outside a CUDA graph (eager mode, piecewise graphs)
pays the launch's host time every step: argument checks, Triton's argument binding and
specialisation key, the driver call. This script measures it for every workload of
``bench_expand.py`` (K=8, block 16), with these variants, each filling preallocated buffers:

  empty             a trivial Triton kernel (one pointer, one program) through ``kernel[grid]``:
                    the floor of a Triton launch
  vllm-layout       vLLM's kernel layout (see bench_expand.py) through its bare ``kernel[grid]``
                    launcher, with no argument checks at all
  default           ``expand_dflash_inputs(..., out=buffers, validate=False)``, default mode
  strict            the same in strict mode (num_blocks_per_row, max_model_len)
  default-uncached  ``default`` with the buffers' launch plans dropped before every call: the
                    argument checks, launch planning and Triton JIT launch of every call (the
                    path every call took before plans were cached)
  default-validate  ``default`` with ``validate=True``: the value checks read tensor data, one
                    device-to-host copy per call, so this one waits for the GPU every call
  vllm-sizes        ``vllm-layout`` on the workload's first num_reqs - i * step requests,
  default-sizes     and ``default`` likewise, i = 0..7 in turn (one batch size per call, as an
                    engine's batch changes from step to step; fewer sizes where there are
                    fewer requests)

Method. A sample of a variant is ``--calls`` back-to-back calls with no synchronisation
between them, after a ``torch.cuda.synchronize()``: the wall time (``time.perf_counter_ns``)
and the launching thread's CPU time (``time.thread_time_ns``) of the loop, each divided by the
number of calls, then a synchronisation whose wait (``drain``) is recorded. Every kernel here runs
in about 2 us on the GPU and every launch costs more host time than that, so the GPU keeps up
and the loop measures the host: a drain no longer than the empty kernel's says it did (a GPU
behind the host would leave a backlog to drain). Calls per sample stay far
below the driver's launch queue. The samples of a workload's variants are taken in turn,
``--rounds`` rounds in a rotating order, with the garbage collector off; cells are medians, and
the ratios are medians of the per-round ratios (paired samples). ``triton.testing.do_bench``
(one launch per call, events around each; Python cost included) is also recorded, as in
bench_expand.py. Every variant is checked against the pure-torch reference (buffers poisoned
first) after it was timed, through the same cached path.

``--fake-device`` runs without a GPU: tensors stay on the CPU, Triton's driver is a stub that
returns device 0 and stream 0, and every compiled kernel is a stub whose launcher does nothing.
What remains is the Python side of each launch path (our checks, plans and direct launch; the
JIT's binding, specialisation and cache lookup), without Triton's C launcher and the driver's
launch call. vLLM's layout passes its 11 tensors to the C launcher, which reads each one's data
pointer and asks the driver about it; ours passes raw pointers: so the stub favours vLLM's path.
It is a profile for this machine, not a result: the results are the GPU runs.

    python benches/gpu/bench_eager.py --json bench_eager.json
    python benches/gpu/bench_eager.py --fake-device --only "decode 1024x9"
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import itertools
import json
import statistics
import sys
import time
from typing import Callable, Iterator, Optional

import bench_expand as bench
import torch
import triton

from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs

VARIANTS = (
    "empty",
    "vllm-layout",
    "default",
    "strict",
    "default-uncached",
    "default-validate",
    "vllm-sizes",
    "default-sizes",
)
PAIRS = {"default": "vllm-layout", "strict": "vllm-layout", "default-sizes": "vllm-sizes"}
NUM_SIZES = 8


# --------------------------------------------------------------------------------------------
# --fake-device: the Python side of each launch path, without a GPU


class _StubKernel:
    """A compiled kernel whose launcher does nothing."""

    function = 1
    packed_metadata = (4, 1, 0)

    @staticmethod
    def run(*args: object) -> None:
        return None

    @staticmethod
    def launch_metadata(*args: object) -> None:
        return None


class _StubDriver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_current_target(self) -> object:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


@contextlib.contextmanager
def fake_device() -> Iterator[None]:
    """Launch paths on CPU tensors that run everything but the C launcher and the driver."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    import dflash_rs.kernels.api as api
    import dflash_rs.kernels.dflash_expand as kernel

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        self.device_caches[device][0][key] = _StubKernel()
        return self.device_caches[device][0][key]

    saved = []

    def patch(owner: object, name: str, value: object) -> None:
        if hasattr(owner, name):
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, value)

    previous = driver._active
    driver.set_active(_StubDriver())
    patch(JITFunction, "_do_compile", stub_compile)
    patch(api, "_interpreting", lambda: True)  # triton_available(cpu)
    patch(torch.cuda, "device", lambda index: contextlib.nullcontext())
    patch(kernel, "_get_device", lambda: 0)
    patch(kernel, "_raw_stream", lambda index: 0)
    patch(kernel, "_direct_launch_ok", True)
    if hasattr(kernel, "ExpandLaunch"):  # CPU plans pose as device 0's, so they launch directly
        init = kernel.ExpandLaunch.__init__

        def as_device_zero(self, args):
            init(self, args)
            self.device_index = 0

        patch(kernel.ExpandLaunch, "__init__", as_device_zero)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)
        driver._active = previous


# --------------------------------------------------------------------------------------------
# Timing


def sample(launch: Callable[[], object], calls: int, sync: Callable[[], None]) -> tuple:
    """(wall us per call, thread CPU us per call, drain us) of ``calls`` back-to-back calls."""
    sync()
    wall0, cpu0 = time.perf_counter_ns(), time.thread_time_ns()
    for _ in range(calls):
        launch()
    cpu1, wall1 = time.thread_time_ns(), time.perf_counter_ns()
    sync()
    drained = time.perf_counter_ns()
    return (wall1 - wall0) / calls / 1e3, (cpu1 - cpu0) / calls / 1e3, (drained - wall1) / 1e3


def time_variants(
    launches: dict[str, Callable[[], object]], calls: int, rounds: int, sync: Callable[[], None]
) -> dict[str, dict[str, float]]:
    names = list(launches)
    samples: dict[str, list[tuple]] = {name: [] for name in names}
    for launch in launches.values():  # warm: compile, plan, first cached launch of every size
        for _ in range(2 * NUM_SIZES):
            launch()
    sync()
    gc.collect()
    gc.disable()
    try:
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(sample(launches[name], calls, sync))
    finally:
        gc.enable()
    result: dict[str, dict[str, float]] = {}
    for name, values in samples.items():
        result[name] = {
            "wall_us": statistics.median(v[0] for v in values),
            "cpu_us": statistics.median(v[1] for v in values),
            "drain_us": statistics.median(v[2] for v in values),
            "wall_us_min": min(v[0] for v in values),
            "wall_us_max": max(v[0] for v in values),
        }
    for name, baseline in PAIRS.items():
        ratios = [ours[0] / theirs[0] for ours, theirs in zip(samples[name], samples[baseline])]
        result[name]["vs_vllm"] = statistics.median(ratios)
        result[name]["vs_vllm_max"] = max(ratios)
    return result


def do_bench_us(launch: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(launch, warmup=25, rep=100, return_mode="median")) * 1000


# --------------------------------------------------------------------------------------------
# Run


def sub_batches(inputs: bench.Inputs) -> list[bench.Inputs]:
    """The workload's first num_reqs - i * step requests, i = 0..NUM_SIZES-1 (distinct sizes)."""
    workload, t = inputs.workload, inputs.tensors
    step = max(1, workload.num_reqs // 32)
    sizes = sorted({max(1, workload.num_reqs - i * step) for i in range(NUM_SIZES)}, reverse=True)
    batches = []
    for num_reqs in sizes:
        lens = workload.context_lens[:num_reqs]
        num_ctx = sum(lens)
        part = bench.Workload(workload.name, lens, workload.first_positions[:num_reqs])
        tensors = {
            "next_token_ids": t["next_token_ids"][:num_reqs],
            "target_positions": t["target_positions"][:num_ctx],
            "query_start_loc": t["query_start_loc"][: num_reqs + 1],
            "block_table": t["block_table"][:num_reqs],
            "num_rejected_tokens": t["num_rejected_tokens"][:num_reqs],
            "num_blocks_per_row": t["num_blocks_per_row"][:num_reqs],
        }
        batches.append(bench.Inputs(part, tensors, max(lens)))
    return batches


def _ours(inputs: bench.Inputs, out: DFlashInputs, **extra: object) -> Callable[[], object]:
    t = inputs.tensors
    positional = (
        t["next_token_ids"],
        t["target_positions"],
        t["query_start_loc"],
        t["block_table"],
    )
    keywords = {
        "block_size": bench.BLOCK,
        "num_speculative_tokens": bench.NUM_SPEC,
        "mask_token_id": bench.MASK_TOKEN_ID,
        "num_rejected_tokens": t["num_rejected_tokens"],
        "out": out,
        "validate": False,
        **extra,
    }
    if extra.get("strict"):
        del keywords["strict"]
        keywords["num_blocks_per_row"] = t["num_blocks_per_row"]
        keywords["max_model_len"] = bench.MAX_MODEL_LEN
    return lambda: expand_dflash_inputs(*positional, **keywords)


def _in_turn(launches: list[Callable[[], object]]) -> Callable[[], object]:
    """One of ``launches`` per call, in turn."""
    turn = itertools.cycle(launches)
    return lambda: next(turn)()


def _vllm(part: bench.Inputs, out: DFlashInputs) -> Callable[[], object]:
    args = bench.prepare(part, strict=False, out=out)  # checked once, outside the timing
    return lambda: bench.launch_vllm_layout(args, part.max_context_len)


def variant_launches(
    inputs: bench.Inputs,
    sizes: list[bench.Inputs],
    outs: dict[str, DFlashInputs],
    empty_target: torch.Tensor,
) -> dict[str, Callable[[], object]]:
    uncached, default = outs["default-uncached"], _ours(inputs, outs["default-uncached"])

    def default_uncached() -> object:
        getattr(uncached, "_launch_plans", {}).clear()
        return default()

    return {
        "empty": lambda: bench._empty_kernel[(1,)](empty_target),
        "vllm-layout": _vllm(inputs, outs["vllm-layout"]),
        "default": _ours(inputs, outs["default"]),
        "strict": _ours(inputs, outs["strict"], strict=True),
        "default-uncached": default_uncached,
        "default-validate": _ours(inputs, outs["default-validate"], validate=True),
        "vllm-sizes": _in_turn([_vllm(part, outs["vllm-sizes"]) for part in sizes]),
        "default-sizes": _in_turn([_ours(part, outs["default-sizes"]) for part in sizes]),
    }


def check_outputs(
    inputs: bench.Inputs,
    sizes: list[bench.Inputs],
    outs: dict[str, DFlashInputs],
    launches: dict[str, Callable[[], object]],
    sync: Callable[[], None],
) -> list[str]:
    """Poison a variant's buffers, launch it once more (the cached path), compare with the
    reference; the variants of several sizes once per size, through the same buffers."""
    failures = []

    def compare(name: str, part: bench.Inputs, launch: Callable[[], object]) -> None:
        out = outs[name]
        for field in bench.OUTPUT_FIELDS:
            getattr(out, field).fill_(-7)
        launch()
        sync()
        got = out.narrow(part.workload.num_reqs, part.workload.num_ctx)
        want = bench.reference_outputs(part, strict=name == "strict")
        label = f"{part.workload.name} {name} ({part.workload.num_reqs} requests)"
        failures.extend(bench.check(label, got, want, not name.startswith("vllm")))

    for name in outs:
        if not name.endswith("-sizes"):
            compare(name, inputs, launches[name])
    for part in sizes:
        compare("vllm-sizes", part, _vllm(part, outs["vllm-sizes"]))
        compare("default-sizes", part, _ours(part, outs["default-sizes"]))
    return failures


def run(args: argparse.Namespace) -> int:
    if args.fake_device:
        device = "cpu"
        context: contextlib.AbstractContextManager = fake_device()

        def sync() -> None:
            return None

    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --fake-device)", file=sys.stderr)
            return 2
        device = "cuda"
        context = contextlib.nullcontext()
        sync = torch.cuda.synchronize
    generator = torch.Generator().manual_seed(args.seed)
    workloads = bench.make_workloads(generator)
    if args.only:
        workloads = [w for w in workloads if any(key in w.name for key in args.only)]
    rows, failures = [], []
    with context:
        empty_target = torch.zeros(1, dtype=torch.int32, device=device)
        if not args.fake_device:
            bench.warm_up(lambda: bench._empty_kernel[(1,)](empty_target), args.warmup_s)
        for workload in workloads:
            inputs = bench.build_inputs(workload, generator, device)
            n, c = workload.num_reqs, workload.num_ctx
            names = [v for v in VARIANTS if v != "empty"]
            outs = {v: DFlashInputs.empty(n, c, bench.NUM_SPEC, device) for v in names}
            sizes = sub_batches(inputs)
            launches = variant_launches(inputs, sizes, outs, empty_target)
            times = time_variants(launches, args.calls, args.rounds, sync)
            if not args.fake_device:
                failures += check_outputs(inputs, sizes, outs, launches, sync)
                if not args.skip_do_bench:
                    for name in ("empty", "vllm-layout", "default", "strict"):
                        times[name]["do_bench_us"] = do_bench_us(launches[name])
            rows.append(
                {
                    "workload": workload.name,
                    "num_reqs": n,
                    "num_ctx": c,
                    "sizes": [part.workload.num_reqs for part in sizes],
                    "times": times,
                }
            )
            print(f"  {workload.name}: done", file=sys.stderr)
    print_table(rows, args)
    if failures:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(failures))
    if args.json:
        report = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": "fake (CPU, stub launcher)"
            if args.fake_device
            else torch.cuda.get_device_name(),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "triton": triton.__version__,
            "num_speculative_tokens": bench.NUM_SPEC,
            "block_size": bench.BLOCK,
            "calls": args.calls,
            "rounds": args.rounds,
            "correct": not failures,
            "failures": failures,
            "rows": rows,
        }
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    return 1 if failures else 0


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    where = "stub launcher, CPU tensors" if args.fake_device else "GPU"
    print(f"\n### Host time per eager call ({where}; us, median of {args.rounds} rounds)\n")
    print(
        "| workload | reqs | ctx | "
        + " | ".join(VARIANTS)
        + " | default / vllm | strict / vllm | sizes: default / vllm | drain (empty, default) |"
    )
    print("|---|---:|---:|" + "---:|" * (len(VARIANTS) + 4))
    for row in rows:
        times = row["times"]
        cells = " | ".join(f"{times[v]['wall_us']:.2f}" for v in VARIANTS)
        ratios = " | ".join(f"{times[v]['vs_vllm']:.2f}x" for v in PAIRS)
        print(
            f"| {row['workload']} | {row['num_reqs']} | {row['num_ctx']} | {cells} | {ratios} | "
            f"{times['empty']['drain_us']:.1f}, {times['default']['drain_us']:.1f} |"
        )
    print("\nThread CPU time per call (us, median):\n")
    print("| workload | " + " | ".join(VARIANTS) + " |")
    print("|---|" + "---:|" * len(VARIANTS))
    for row in rows:
        cells = " | ".join(f"{row['times'][v]['cpu_us']:.2f}" for v in VARIANTS)
        print(f"| {row['workload']} | {cells} |")
    if not args.fake_device and not args.skip_do_bench:
        print("\ntriton.testing.do_bench, one launch per call (us, median):\n")
        shown = ("empty", "vllm-layout", "default", "strict")
        print("| workload | " + " | ".join(shown) + " |")
        print("|---|" + "---:|" * len(shown))
        for row in rows:
            cells = " | ".join(f"{row['times'][v]['do_bench_us']:.2f}" for v in shown)
            print(f"| {row['workload']} | {cells} |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results to this path")
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls per sample")
    parser.add_argument("--rounds", type=int, default=21, help="samples per variant")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="GPU warm-up before sampling")
    parser.add_argument("--skip-do-bench", action="store_true", help="no do_bench column")
    parser.add_argument("--fake-device", action="store_true", help="no GPU: stub launcher")
    parser.add_argument("--only", nargs="*", help="run workloads whose name contains these")
    parser.add_argument("--seed", type=int, default=0)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
