"""Small, fast simulation settings shared by the simulate tests."""

from __future__ import annotations

from typing import Any

from dflash_rs.sim.config import SimConfig

#: About one second per run on a 2-core CPU; memory pressure makes requests preempt and resume.
#: The torch reference kernel is used (tests run Triton under its slow interpreter on CPU).
SMALL = dict(num_requests=40, num_blocks=150, max_model_len=2048, kernel="reference")

SMALL_ARGS = [
    *("--num-requests", "24", "--num-blocks", "130", "--max-model-len", "2048"),
    *("--kernel", "reference"),
]


def small_config(**overrides: Any) -> SimConfig:
    return SimConfig(**{**SMALL, **overrides})
