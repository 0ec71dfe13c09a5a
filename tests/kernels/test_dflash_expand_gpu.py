"""The compiled kernel on a CUDA GPU: against the reference and oracle, and inside a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dflash_expand_oracle import Case, assert_matches, oracle, poison, random_case

from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SHAPES = [  # (num_reqs, num_ctx, K, block_size, lengths)
    (1, 9, 8, 16, "uniform"),
    (1024, 9 * 1024, 8, 16, "uniform"),
    (1000, 9000, 8, 16, "one_long"),
    (4, 8192, 8, 16, "uniform"),
    (64, 64 * 512, 8, 32, "random"),
    (4097, 20000, 3, 128, "random"),
    (333, 2000, 15, 1, "random"),
    (1024, 5021, 8, 16, "random"),  # ragged decode: stage-1 windows
    (256, 4343, 8, 16, "one_long"),  # skewed: stage-2 windows
    (2000, 3000, 8, 16, "random"),  # under 4 tokens a request: per-lane probes
]


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(("num_reqs", "num_ctx", "k", "block", "lengths"), SHAPES)
def test_compiled_kernel_matches_reference(
    seeded_rng, num_reqs, num_ctx, k, block, lengths, strict
):
    seed, rng = seeded_rng
    case = random_case(
        rng,
        seed,
        num_reqs=num_reqs,
        num_ctx=num_ctx,
        num_spec=k,
        block_size=block,
        rejected=True,
        strict=strict,
        lengths=lengths,
        clamp=rng.random() < 0.3,
    )
    expected = oracle(case)
    positional, keywords = case.torch_args("cuda")
    for backend in ("triton", "reference"):
        result = expand_dflash_inputs(
            *positional, **keywords, out=case.poisoned_out("cuda"), backend=backend
        )
        assert_matches(result, expected, case, f"cuda {backend}")


def _fixed_shape_case(
    rng: np.random.Generator, seed: int, num_reqs: int, num_ctx: int, width: int, strict: bool
) -> Case:
    """A random batch of fixed shapes, so new data can be copied into captured tensors."""
    k, block = 8, 16
    cuts = np.sort(rng.choice(num_ctx - 1, num_reqs - 1, replace=False) + 1)
    lens = np.diff(np.concatenate([[0], cuts, [num_ctx]]))
    starts = rng.integers(0, (width - 2) * block - lens.max() - k, num_reqs)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    table = rng.integers(0, 4000, (num_reqs, width)).astype(np.int32)
    return Case(
        next_token_ids=rng.integers(0, 150_000, num_reqs).astype(np.int32),
        target_positions=positions.astype(np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        block_table=table,
        table_rows=num_reqs,
        table_width=width,
        num_speculative_tokens=k,
        block_size=block,
        mask_token_id=151_000,
        num_rejected_tokens=np.minimum(rng.integers(0, k + 1, num_reqs), lens - 1).astype(np.int32),
        num_blocks_per_row=rng.integers(0, width + 1, num_reqs).astype(np.int32)
        if strict
        else None,
        max_model_len=int((width - 3) * block) if strict else None,
        extra_reqs=5,
        extra_ctx=33,
        seed=seed,
    )


@pytest.mark.parametrize("strict", [False, True])
def test_cuda_graph_replay_with_out_buffers(seeded_rng, strict):
    """Capture three launches into preallocated buffers, then replay on fresh data in place."""
    seed, rng = seeded_rng
    num_reqs, num_ctx, width = 96, 900, 40
    first = _fixed_shape_case(rng, seed, num_reqs, num_ctx, width, strict)
    static_args, keywords = first.torch_args("cuda")
    static_kwargs = {name: v for name, v in keywords.items() if isinstance(v, torch.Tensor)}
    scalars = {name: v for name, v in keywords.items() if not isinstance(v, torch.Tensor)}
    out = DFlashInputs.empty(num_reqs + 5, num_ctx + 33, 8, "cuda")

    def launch() -> None:
        expand_dflash_inputs(*static_args, **static_kwargs, **scalars, out=out, validate=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            launch()

    for _ in range(3):
        case = _fixed_shape_case(rng, seed, num_reqs, num_ctx, width, strict)
        new_args, new_keywords = case.torch_args("cuda")
        for static, fresh in zip(static_args, new_args):
            static.copy_(fresh)
        for name, tensor in static_kwargs.items():
            tensor.copy_(new_keywords[name])
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, oracle(case), case, "cuda graph replay")


def test_cuda_graph_replay_accumulates_violations(seeded_rng):
    """accumulate_violations inside a graph: each replay adds its launches' counts to the
    per-program slots, and reset_violations() (outside the graph) starts again from zero."""
    seed, rng = seeded_rng
    num_reqs, num_ctx, width = 96, 900, 40
    case = _fixed_shape_case(rng, seed, num_reqs, num_ctx, width, strict=True)
    per_launch = oracle(case)["num_violations"][0]
    static_args, keywords = case.torch_args("cuda")
    out = DFlashInputs.empty(num_reqs, num_ctx, 8, "cuda")

    def launch() -> None:
        expand_dflash_inputs(
            *static_args, **keywords, out=out, validate=False, accumulate_violations=True
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):
            launch()
    out.reset_violations()
    graph.replay()
    graph.replay()
    assert out.num_violations.tolist() == [6 * per_launch]
    out.reset_violations()
    graph.replay()
    assert out.num_violations.tolist() == [3 * per_launch]
