"""Kernel == torch reference == plain-Python oracle on fresh random batches.

Every run draws new inputs; a failure names its seed (replay with DFLASH_KERNEL_TEST_SEED).
Outputs are poisoned first, so a lane the kernel forgets to write fails.
"""

from __future__ import annotations

import numpy as np
import pytest
from dflash_expand_oracle import POISON, Case, assert_matches, oracle, random_case
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_rs.kernels import expand_dflash_inputs

BACKENDS = ("triton", "reference")


def _check_case(case: Case, device: str) -> None:
    expected = oracle(case)
    positional, keywords = case.torch_args(device)
    for backend in BACKENDS:
        out = case.poisoned_out(device)
        result = expand_dflash_inputs(*positional, **keywords, out=out, backend=backend)
        assert result is out
        assert_matches(result, expected, case, backend)
        # num_violations (compared above) sums the slots: a slot left poisoned would show.
        assert not (out.violation_partials == POISON).any(), f"{backend}: a slot not written"


# (num_reqs, num_ctx, K, block_size, rejected, lengths, clamp): many small shapes.
SMALL = [
    (1, 1, 1, 1, False, "random", False),
    (1, 5, 15, 16, True, "random", False),
    (2, 2, 3, 16, False, "uniform", True),
    (3, 40, 8, 32, True, "random", False),
    (5, 45, 8, 16, True, "uniform", False),
    (7, 70, 4, 128, False, "one_long", True),
    (8, 8, 2, 1, True, "uniform", True),
    (13, 200, 15, 16, True, "random", True),
    (31, 62, 1, 32, False, "uniform", False),
    (33, 300, 7, 16, True, "one_long", False),
    (40, 120, 5, 1, True, "random", False),
    (64, 576, 8, 16, True, "uniform", False),
    (64, 400, 11, 128, False, "random", True),
    (100, 100, 6, 32, False, "uniform", True),
]
LARGE = [
    (1024, 9 * 1024 // 2, 8, 16, True, "random", False),
    (1024, 4096, 15, 16, True, "uniform", False),
    (1023, 4096, 3, 1, False, "one_long", True),
    (300, 4096, 8, 128, True, "random", True),
    (4, 4096, 8, 32, False, "random", False),
    (1, 4096, 15, 16, True, "uniform", False),
]


@pytest.mark.parametrize(
    ("num_reqs", "num_ctx", "k", "block", "rejected", "lengths", "clamp"), SMALL
)
def test_default_mode_small(
    seeded_rng, device, num_reqs, num_ctx, k, block, rejected, lengths, clamp
):
    seed, rng = seeded_rng
    for _ in range(2):
        case = random_case(
            rng,
            seed,
            num_reqs=num_reqs,
            num_ctx=num_ctx,
            num_spec=k,
            block_size=block,
            rejected=rejected,
            lengths=lengths,
            clamp=clamp,
        )
        _check_case(case, device)


@pytest.mark.parametrize(
    ("num_reqs", "num_ctx", "k", "block", "rejected", "lengths", "clamp"), LARGE
)
def test_default_mode_large(
    seeded_rng, device, num_reqs, num_ctx, k, block, rejected, lengths, clamp
):
    seed, rng = seeded_rng
    case = random_case(
        rng,
        seed,
        num_reqs=num_reqs,
        num_ctx=num_ctx,
        num_spec=k,
        block_size=block,
        rejected=rejected,
        lengths=lengths,
        clamp=clamp,
    )
    _check_case(case, device)


@pytest.mark.parametrize(
    ("num_reqs", "num_ctx", "k", "block", "rejected", "lengths", "clamp"), SMALL
)
def test_strict_mode_small(
    seeded_rng, device, num_reqs, num_ctx, k, block, rejected, lengths, clamp
):
    seed, rng = seeded_rng
    case = random_case(
        rng,
        seed,
        num_reqs=num_reqs,
        num_ctx=num_ctx,
        num_spec=k,
        block_size=block,
        rejected=rejected,
        lengths=lengths,
        clamp=clamp,
        strict=True,
    )
    _check_case(case, device)


@pytest.mark.parametrize(
    ("num_reqs", "num_ctx", "k", "block", "rejected", "lengths", "clamp"), LARGE[:3]
)
def test_strict_mode_large(
    seeded_rng, device, num_reqs, num_ctx, k, block, rejected, lengths, clamp
):
    seed, rng = seeded_rng
    case = random_case(
        rng,
        seed,
        num_reqs=num_reqs,
        num_ctx=num_ctx,
        num_spec=k,
        block_size=block,
        rejected=rejected,
        lengths=lengths,
        clamp=clamp,
        strict=True,
    )
    _check_case(case, device)


def test_exact_size_outputs_without_out(seeded_rng, device):
    """Without out= the buffers are exactly the batch's size (no padding lanes)."""
    seed, rng = seeded_rng
    case = random_case(
        rng, seed, num_reqs=9, num_ctx=81, num_spec=8, block_size=16, rejected=True, padding=False
    )
    expected = oracle(case)
    positional, keywords = case.torch_args(device)
    for backend in BACKENDS:
        assert_matches(
            expand_dflash_inputs(*positional, **keywords, backend=backend), expected, case, backend
        )


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 2**63 - 1),
    num_reqs=st.integers(1, 12),
    tokens_per_req=st.integers(1, 20),
    k=st.integers(1, 15),
    block=st.sampled_from([1, 16, 32, 128]),
    rejected=st.booleans(),
    strict=st.booleans(),
    lengths=st.sampled_from(["random", "uniform", "one_long"]),
    clamp=st.booleans(),
)
def test_hypothesis_small_batches(
    device, seed, num_reqs, tokens_per_req, k, block, rejected, strict, lengths, clamp
):
    case = random_case(
        np.random.default_rng(seed),
        seed,
        num_reqs=num_reqs,
        num_ctx=num_reqs * tokens_per_req,
        num_spec=k,
        block_size=block,
        rejected=rejected,
        strict=strict,
        lengths=lengths,
        clamp=clamp,
    )
    _check_case(case, device)
