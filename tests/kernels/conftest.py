"""Fixtures of the kernel tests: the device to run on and a fresh, reported random seed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dflash_expand_oracle import SEED_ENV, fresh_seed


@pytest.fixture
def device() -> str:
    """CUDA when present (compiled kernel), else CPU (Triton interpreter, see tests/conftest.py)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def seeded_rng() -> tuple[int, np.random.Generator]:
    """A new seed per test; printed so a failure's captured output says how to replay it."""
    seed = fresh_seed()
    print(f"random seed {seed}; replay with {SEED_ENV}={seed}")
    return seed, np.random.default_rng(seed)
