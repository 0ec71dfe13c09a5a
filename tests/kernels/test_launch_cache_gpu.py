"""Cached launch plans on a CUDA GPU: direct launches of the compiled kernel, CUDA-graph capture
through them, and the cases that keep Triton's JIT path (launch hooks, a refused launcher)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dflash_expand_oracle import assert_matches, oracle, poison, random_case
from test_launch_cache import _batch, _new_data

from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture
def jit_launches(monkeypatch) -> list[int]:
    """Counts launches through Triton's JIT (binding, specialisation, cache lookup)."""
    import dflash_rs.kernels.dflash_expand as kernel_module

    calls = [0]
    jit = kernel_module._dflash_expand_kernel
    run = jit.run

    def counting(*args, **kwargs):
        calls[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(jit, "run", counting)
    return calls


def _gpu_case(seeded_rng, strict: bool):
    seed, rng = seeded_rng
    case = random_case(
        rng, seed, num_reqs=300, num_ctx=2700, num_spec=8, block_size=16, rejected=True,
        strict=strict,
    )  # fmt: skip
    return case, case.torch_args("cuda")


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("validate", [True, False])
def test_cached_calls_launch_the_compiled_kernel_directly(
    seeded_rng, jit_launches, strict, validate
):
    (case, (positional, keywords)) = _gpu_case(seeded_rng, strict)
    out = case.poisoned_out("cuda")
    expected = oracle(case)
    for call in range(3):
        poison(out)
        expand_dflash_inputs(*positional, **keywords, out=out, validate=validate)
        assert_matches(out, expected, case, f"call {call}")
    assert jit_launches[0] == 1
    (plan,) = out._launch_plans.values()
    assert len(plan._kernels) == 1


def test_batches_of_other_sizes_launch_directly_once_their_variant_is_compiled(
    seeded_rng, jit_launches
):
    """Batch sizes that select the same kernel variant launch it directly from the first call;
    a size that selects another variant goes through the JIT once."""
    seed, rng = seeded_rng
    table = rng.integers(0, 5000, (1100, 40)).astype(np.int32)
    out = DFlashInputs.empty(1024, 9216, 4, "cuda")
    sizes = [(1000, 9000), (1001, 9009), (1002, 9018), (40, 360), (1003, 9027)]
    for num_reqs, num_ctx in sizes:
        case = _batch(rng, num_reqs, num_ctx, table)
        case.extra_reqs, case.extra_ctx = 1024 - num_reqs, 9216 - num_ctx
        case.seed = seed
        positional, keywords = case.torch_args("cuda")
        poison(out)
        expand_dflash_inputs(*positional, **keywords, out=out, validate=False)
        assert_matches(out, oracle(case), case, f"{num_reqs} requests")
    (plan,) = out._launch_plans.values()
    assert len(plan._kernels) == 2  # 1000-1003 requests share one variant, 40 another
    assert jit_launches[0] == 2


def test_cuda_graph_capture_through_the_cached_path(seeded_rng, jit_launches):
    """Captured calls are cached ones (the first ran outside the capture): the graph replays
    the directly launched kernel, on data copied into the captured tensors."""
    (case, (positional, keywords)) = _gpu_case(seeded_rng, strict=True)
    out = case.poisoned_out("cuda")
    expand_dflash_inputs(*positional, **keywords, out=out, validate=False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        expand_dflash_inputs(*positional, **keywords, out=out, validate=False)
    assert jit_launches[0] == 1
    fresh = _new_data(case, np.random.default_rng(case.seed + 1))
    new_positional, new_keywords = fresh.torch_args("cuda")
    for tensor, new in zip(positional, new_positional):
        tensor.copy_(new)
    for name in ("num_rejected_tokens", "num_blocks_per_row"):
        keywords[name].copy_(new_keywords[name])
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, oracle(fresh), fresh, "graph replay")


def test_launch_hooks_get_the_jit_path(seeded_rng, jit_launches):
    """With a launch hook installed (a profiler), cached calls go through the JIT, which gives
    the hook its launch metadata; without one they launch directly again."""
    import triton

    (case, (positional, keywords)) = _gpu_case(seeded_rng, strict=False)
    out = case.poisoned_out("cuda")
    seen: list[str] = []

    def hook(metadata) -> None:
        seen.append(metadata.get()["name"])

    expand_dflash_inputs(*positional, **keywords, out=out)
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        expand_dflash_inputs(*positional, **keywords, out=out)
        expand_dflash_inputs(*positional, **keywords, out=out)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    expand_dflash_inputs(*positional, **keywords, out=out)
    assert seen == ["_dflash_expand_kernel"] * 2
    assert jit_launches[0] == 3
    assert_matches(out, oracle(case), case, "after hooks")


def test_a_launcher_that_refuses_the_arguments_falls_back_to_the_jit(
    seeded_rng, jit_launches, monkeypatch
):
    """Another Triton version's launcher convention: the refused direct launch ran nothing,
    the JIT launches instead, and direct launches stay off for the process."""
    import dflash_rs.kernels.dflash_expand as kernel_module

    monkeypatch.setattr(kernel_module, "_direct_launch_ok", True)
    (case, (positional, keywords)) = _gpu_case(seeded_rng, strict=False)
    out = case.poisoned_out("cuda")
    expand_dflash_inputs(*positional, **keywords, out=out)
    (plan,) = out._launch_plans.values()

    def refuse(*args):
        raise TypeError("function takes exactly 38 arguments")

    ((key, compiled),) = plan._kernels.items()
    plan._kernels[key] = (refuse, *compiled[1:])
    poison(out)
    expand_dflash_inputs(*positional, **keywords, out=out)
    assert_matches(out, oracle(case), case, "after the fallback")
    assert kernel_module._direct_launch_ok is False and not plan._kernels
    expand_dflash_inputs(*positional, **keywords, out=out)
    assert jit_launches[0] == 3 and not plan._kernels
