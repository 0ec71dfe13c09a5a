"""Fixtures of the simulate tests: one small correct run, shared by the report tests."""

from __future__ import annotations

import pytest

from dflash_rs.sim.engine import run_simulation
from dflash_rs.sim.metrics import SimResult

from .helpers import small_config


@pytest.fixture(scope="package")
def correct_run() -> SimResult:
    return run_simulation(small_config())
