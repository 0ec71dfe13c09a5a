"""dflash-rs as a drop-in scheduler for vLLM 0.32 and 0.33 (``pip install 'dflash-rs[vllm]'``).

    vllm serve MODEL --scheduler-cls dflash_rs.vllm.DFlashRsScheduler

``DFlashRsScheduler`` implements vLLM's ``SchedulerInterface``, with ``AsyncScheduler``'s
placeholder semantics under async scheduling; the per-step work runs in the Rust core. vLLM is
imported on first use of ``DFlashRsScheduler`` (``import dflash_rs`` never imports it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# The vLLM release series the drop-in is written and tested against, oldest first (what
# differs between them: ``dflash_rs.vllm._compat``, which imports no vLLM).
from dflash_rs.vllm._compat import SUPPORTED_SERIES as SUPPORTED_VLLM

if TYPE_CHECKING:
    from dflash_rs.vllm.scheduler import DFlashRsScheduler

__all__ = ["SUPPORTED_VLLM", "DFlashRsScheduler"]


def __getattr__(name: str) -> Any:
    if name == "DFlashRsScheduler":
        from dflash_rs.vllm.scheduler import DFlashRsScheduler

        return DFlashRsScheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
