"""Test-only vLLM general plugin: entry point ``dflash_rs_test_cpu_fixes`` (vllm.general_plugins).

It exists so that the real-engine tests (``tests/engine``) can run DFlash drafting on vLLM's
CPU build. That build prepacks the linear layers' GEMM weights and leaves each ``weight`` an
empty tensor, but ``DFlashQwen3Model._build_context_kv_buffers`` still fuses the context KV
projection from ``qkv_proj.weight`` slices, and the first draft step then fails with "size
mismatch, got input (..), mat (..x256), vec (0)". vLLM's upstream fix only fuses non-empty
weights; ``register`` gets the same effect by wrapping the method: after it runs, empty weights
drop the fused buffers, so the per-layer projections (which use the packed weights) run instead.

This is a fix for the tests' environment, never part of the dflash-rs product: the scheduler
does not touch model code. ``register`` is idempotent (vLLM may load plugins several times) and
does nothing where the method is absent.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["MARKER", "register"]

#: Attribute set on the wrapped method (also recognised by benches/vllm_engine_e2e.py).
MARKER = "_dflash_rs_cpu_guard"


def register() -> None:
    """Installs the DFlash context-KV guard once per process."""
    try:
        from vllm.model_executor.models import qwen3_dflash
    except ImportError:
        return
    cls = getattr(qwen3_dflash, "DFlashQwen3Model", None)
    orig = getattr(cls, "_build_context_kv_buffers", None)
    if orig is None or getattr(orig, MARKER, False):
        return

    @functools.wraps(orig)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        if any(proj.weight.numel() == 0 for proj in self._context_qkv_projs):
            self._fused_kv_weight = None
            self._fused_kv_bias = None

    setattr(guarded, MARKER, True)
    cls._build_context_kv_buffers = guarded
