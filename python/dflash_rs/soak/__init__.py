"""``dflash-rs soak``: many requests through the scheduler alone, under memory pressure.

``config`` holds the run's settings, ``workload`` the seeded request stream, ``ownership`` the
per-step block-table checks, ``memory`` the RSS and heap readings, ``runner`` the step loop,
``report`` the result and its verdict, ``cli`` the subcommand (its docstring is the command's
description).
"""

from __future__ import annotations

from dflash_rs.soak.config import SoakConfig
from dflash_rs.soak.memory import rss_bytes
from dflash_rs.soak.ownership import OwnershipCheck, required_lookahead
from dflash_rs.soak.report import SoakReport
from dflash_rs.soak.runner import Progress, SoakRun, run_soak

__all__ = [
    "OwnershipCheck",
    "Progress",
    "SoakConfig",
    "SoakReport",
    "SoakRun",
    "required_lookahead",
    "rss_bytes",
    "run_soak",
]
