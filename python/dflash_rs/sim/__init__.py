"""``dflash-rs simulate``: a serving simulation that proves KV integrity on a real paged KV cache.

The step loop (``engine``) drives the real Rust scheduler with a seeded workload (``workload``),
hands its zero-copy block table to the DFlash expansion kernel, lets a stand-in model write
tagged values into a paged KV tensor (``model``, ``kv_store``, ``tags``), reads every live
request's context back (``verifier``) and feeds sampled tokens and drafts back to the scheduler
(``sampler``). ``report`` renders the result; ``cli`` wires the subcommand.

Names are imported on first use, so ``dflash_rs.sim.cli`` loads without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SimConfig",
    "SimResult",
    "Simulation",
    "SimulationError",
    "Workload",
    "WorkloadConfig",
    "run_simulation",
]

_HOMES = {
    "SimConfig": "config",
    "SimResult": "metrics",
    "Simulation": "engine",
    "SimulationError": "engine",
    "Workload": "workload",
    "WorkloadConfig": "workload",
    "run_simulation": "engine",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'dflash_rs.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dflash_rs.sim.{_HOMES[name]}"), name)
