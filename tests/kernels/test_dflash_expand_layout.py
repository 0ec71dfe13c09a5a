"""Every row-lookup path and the per-program violation slots of the Triton kernel.

A context tile finds its rows by a binary search in a window of query_start_loc around a guess
(stage 1), in a window picked by coarse samples (stage 2), or lane by lane (fallback); batches of
under a few tokens a request first probe each lane's uniform-batch row (probe). Which one runs
depends on the batch's shape and on module constants, so each batch shape below also runs with
constants patched to force every path, and must match the oracle each time. Violation counts are
per-program slots summed when read: they must be exact over many programs, with ``out=``
buffers, narrowed views and accumulation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dflash_expand_oracle import OUTPUT_FIELDS, POISON, assert_matches, oracle, random_case

from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels import DFlashInputs, _grid, expand_dflash_inputs
from dflash_rs.kernels import dflash_expand as kernel

# Constants patched to force each row-lookup path (the first is the shipped configuration).
CONFIGS = {
    "chosen": {},
    # Probe first, the windows only where a probe missed.
    "probe": {"PROBE_SPAN": -1},
    # Never probe: the windows (and the fallback) for every batch.
    "window": {"PROBE_SPAN": 10**9},
    # The largest window for every batch (the chosen size depends on the rows a tile spans).
    "window64": {"PROBE_SPAN": 10**9, "WINDOW_MARGIN": 64},
    # Windows too small for most tiles: stage 2 and the fallback search run.
    "stage2": {"PROBE_SPAN": 10**9, "MAX_WINDOW": 4},
    # Many small programs: many violation slots, tiles spanning few rows.
    "tiles16": {"QUERY_TILE": 16, "CONTEXT_TILE": 16},
}


def _lengths(shape: str, rng: np.random.Generator) -> list[int]:
    """Context lengths per request of a named batch shape."""
    if shape == "uniform":  # decode: every tile inside its stage-1 window
        return [9] * 100
    if shape == "ragged":  # decode with rejections folded in: 1..9 tokens
        return rng.integers(1, 10, 300).tolist()
    if shape == "skewed":  # one long prefill first: the uniform guess is far off
        return [600] + [9] * 60
    if shape == "cluster":  # a run of one-token requests inside long ones: tiles span 128 rows
        return [40] * 20 + [1] * 150 + [40] * 20
    if shape == "one_token":  # one row per lane: the probe, exact
        return [1] * 200
    if shape == "dense_ragged":  # the probe misses: the windows, then the fallback search
        return rng.integers(1, 4, 200).tolist()
    if shape == "many":  # over 1024 requests: a fallback search with fine steps
        return rng.integers(1, 4, 1100).tolist()
    if shape == "two":
        return [5, 3]
    if shape == "one":
        return [7]
    raise ValueError(shape)


SHAPES = (
    "uniform",
    "ragged",
    "skewed",
    "cluster",
    "one_token",
    "dense_ragged",
    "many",
    "two",
    "one",
)


@pytest.fixture
def patch_constants(monkeypatch):
    def apply(config: str) -> None:
        for name, value in CONFIGS[config].items():
            module = _grid if hasattr(_grid, name) else kernel
            assert hasattr(module, name), name
            monkeypatch.setattr(module, name, value)

    return apply


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_row_lookup_path_matches_the_oracle(
    device, seeded_rng, patch_constants, shape, config, strict
):
    seed, rng = seeded_rng
    patch_constants(config)
    case = random_case(
        rng,
        seed,
        num_reqs=0,
        num_ctx=0,
        num_spec=int(rng.integers(1, 9)),
        block_size=int(rng.choice([1, 16, 32])),
        rejected=bool(rng.random() < 0.7),
        strict=strict,
        context_lens=_lengths(shape, rng),
    )
    positional, keywords = case.torch_args(device)
    out = case.poisoned_out(device)  # allocated under the patched tile sizes
    result = expand_dflash_inputs(*positional, **keywords, out=out, backend="triton")
    assert_matches(result, oracle(case), case, f"triton[{config}]")
    assert not (out.violation_partials == POISON).any(), "a violation slot was not written"


@pytest.mark.parametrize("config", ["chosen", "probe", "window", "stage2"])
def test_empty_requests_between_others(device, seeded_rng, patch_constants, config):
    """CUDA-graph padding style empty ranges, also mid-batch: a lane's row is the last request
    whose range starts at or before it (validate=False; against the torch reference)."""
    seed, rng = seeded_rng
    patch_constants(config)
    lens = rng.integers(0, 12, 150)
    lens[rng.random(150) < 0.3] = 0
    lens[0] = max(int(lens[0]), 1)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    num_reqs, num_ctx = len(lens), int(lens.sum())
    table = torch.tensor(rng.integers(1, 5000, (num_reqs, 64)), dtype=torch.int32, device=device)
    args = (
        torch.tensor(rng.integers(0, 1000, num_reqs), dtype=torch.int32, device=device),
        torch.tensor(rng.integers(0, 900, num_ctx), dtype=torch.int64, device=device),
        qsl,
        table,
    )
    keywords = dict(
        block_size=16,
        num_speculative_tokens=4,
        mask_token_id=7,
        num_blocks_per_row=torch.tensor(
            rng.integers(0, 65, num_reqs), dtype=torch.int32, device=device
        ),
        validate=False,
    )
    got = expand_dflash_inputs(*args, **keywords, backend="triton")
    want = expand_dflash_inputs(*args, **keywords, backend="reference")
    for name in OUTPUT_FIELDS:
        assert torch.equal(getattr(got, name), getattr(want, name)), f"{name} (seed {seed})"


def _strict_batch(device: str, num_reqs: int, owned: int):
    """num_reqs requests of 9 context tokens at positions 0..8 (K=8, block 16): with ``owned``
    blocks a row, lanes at positions >= 16 * owned are violations."""
    lens = [9] * num_reqs
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=device)
    args = (
        torch.arange(num_reqs, dtype=torch.int32, device=device),
        torch.arange(9, dtype=torch.int64, device=device).repeat(num_reqs),
        qsl,
        torch.arange(1, 4 * num_reqs + 1, dtype=torch.int32, device=device).view(num_reqs, 4),
    )
    per_row = torch.full((num_reqs,), owned, dtype=torch.int32, device=device)
    common = dict(block_size=16, num_speculative_tokens=8, mask_token_id=1)
    return args, per_row, common


def _expected_violations(num_reqs: int, owned: int) -> int:
    # Context positions 0..8 and query positions 9..17 per request.
    return num_reqs * sum(1 for p in range(18) if p // 16 >= owned)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_counts_are_exact_across_many_programs(device, backend):
    num_reqs = 70  # 630 query + 630 context lanes: 10 programs of 128 lanes
    args, _, common = _strict_batch(device, num_reqs, 0)
    out = DFlashInputs.empty(num_reqs, 9 * num_reqs, 8, device)
    assert out.violation_partials.numel() == _grid.num_programs(9 * num_reqs, 9 * num_reqs)
    for owned in (0, 1, 2, 0):
        per_row = torch.full((num_reqs,), owned, dtype=torch.int32, device=device)
        out.violation_partials.fill_(POISON)
        result = expand_dflash_inputs(
            *args, **common, num_blocks_per_row=per_row, out=out, backend=backend
        )
        assert result.num_violations.tolist() == [_expected_violations(num_reqs, owned)]
        assert result.num_violations.dtype == torch.int32
    if backend == "triton":  # the count is spread over the programs' slots
        assert int((out.violation_partials > 0).sum()) > 1
    expand_dflash_inputs(*args, **common, out=out, backend=backend)  # default mode
    assert out.num_violations.tolist() == [0] and not out.violation_partials.any()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_narrowed_launch_clears_the_parents_other_slots(device, backend):
    """A launch into a narrowed view runs fewer programs than the parent's slots; the slots past
    its grid must read 0 afterwards, so the parent and the view report the same count."""
    num_reqs = 70
    args, per_row, common = _strict_batch(device, num_reqs, 0)
    parent = DFlashInputs.empty(2 * num_reqs, 2 * 9 * num_reqs, 8, device)
    expand_dflash_inputs(*args, **common, num_blocks_per_row=per_row, out=parent, backend=backend)
    assert parent.num_violations.tolist() == [_expected_violations(num_reqs, 0)]
    small_args, small_rows, _ = _strict_batch(device, 3, 1)
    view = parent.narrow(3, 27)
    parent.violation_partials.fill_(POISON)
    expand_dflash_inputs(
        *small_args, **common, num_blocks_per_row=small_rows, out=view, backend=backend
    )
    expected = [_expected_violations(3, 1)]
    assert view.num_violations.tolist() == expected
    assert parent.num_violations.tolist() == expected


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_accumulated_counts_over_views_and_reset(device, backend):
    num_reqs = 70
    args, per_row, common = _strict_batch(device, num_reqs, 1)
    small_args, small_rows, _ = _strict_batch(device, 3, 0)
    parent = DFlashInputs.empty(num_reqs, 9 * num_reqs, 8, device)
    view = parent.narrow(3, 27)
    big, small = _expected_violations(num_reqs, 1), _expected_violations(3, 0)
    run = dict(accumulate_violations=True, backend=backend)
    expand_dflash_inputs(*args, **common, num_blocks_per_row=per_row, out=parent, **run)
    expand_dflash_inputs(*small_args, **common, num_blocks_per_row=small_rows, out=view, **run)
    expand_dflash_inputs(*args, **common, num_blocks_per_row=per_row, out=parent, **run)
    assert parent.num_violations.tolist() == [2 * big + small]
    assert view.num_violations.tolist() == [2 * big + small]  # one set of slots
    parent.reset_violations()
    assert parent.num_violations.tolist() == [0]
    expand_dflash_inputs(*small_args, **common, num_blocks_per_row=small_rows, out=view, **run)
    assert parent.num_violations.tolist() == [small]


def test_num_violations_is_read_when_asked(device):
    """A fresh int32 [1] sum on every read: it follows later launches into the same buffers."""
    args, per_row, common = _strict_batch(device, 5, 0)
    out = DFlashInputs.empty(5, 45, 8, device)
    expand_dflash_inputs(*args, **common, num_blocks_per_row=per_row, out=out)
    first = out.num_violations
    assert first.shape == (1,) and first.dtype == torch.int32
    assert first.tolist() == [_expected_violations(5, 0)]
    expand_dflash_inputs(*args, **common, out=out)
    assert out.num_violations.tolist() == [0]
    assert first.tolist() == [_expected_violations(5, 0)]  # an earlier read keeps its value


def test_out_with_too_few_violation_slots_is_rejected(device):
    args, per_row, common = _strict_batch(device, 70, 0)
    good = DFlashInputs.empty(70, 630, 8, device)
    bad = DFlashInputs(
        input_ids=good.input_ids,
        query_positions=good.query_positions,
        query_slot_mapping=good.query_slot_mapping,
        context_positions=good.context_positions,
        context_slot_mapping=good.context_slot_mapping,
        token_indices_to_sample=good.token_indices_to_sample,
        num_speculative_tokens=8,
        violation_partials=torch.zeros(1, dtype=torch.int32, device=device),
    )
    with pytest.raises(InvalidArgumentError, match="violation_partials"):
        expand_dflash_inputs(*args, **common, num_blocks_per_row=per_row, out=bad)
