"""The test-only vLLM plugin of ``tests/engine/plugin`` (installed by scripts/vllm_cpu_env.sh)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)
plugin = pytest.importorskip(
    "dflash_rs_test_plugin", reason="the test plugin is installed by scripts/vllm_cpu_env.sh"
)


def dflash_model() -> Any:
    from vllm.model_executor.models import qwen3_dflash

    return qwen3_dflash.DFlashQwen3Model


def layer(weight_rows: int) -> Any:
    """What ``_build_context_kv_buffers`` reads of an attention layer (q_size 4, kv 2 + 2)."""
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    qkv = SimpleNamespace(
        quant_method=UnquantizedLinearMethod(),
        weight=torch.ones(weight_rows, 3) if weight_rows else torch.empty(0),
    )
    return SimpleNamespace(qkv_proj=qkv, q_size=4, k_norm=SimpleNamespace(weight=torch.ones(2)))


def test_register_is_idempotent() -> None:
    cls = dflash_model()
    plugin.register()
    wrapped = cls._build_context_kv_buffers
    plugin.register()
    assert cls._build_context_kv_buffers is wrapped
    assert getattr(wrapped, plugin.MARKER)
    assert not hasattr(wrapped.__wrapped__, plugin.MARKER)


@pytest.mark.parametrize("rows", [0, 8])
def test_guard_drops_fused_buffers_of_empty_weights(rows: int) -> None:
    import torch

    plugin.register()
    model = SimpleNamespace(hidden_norm=SimpleNamespace(weight=torch.ones(3)))
    dflash_model()._build_context_kv_buffers(model, [layer(rows), layer(rows)], False)
    if rows:
        assert model._fused_kv_weight.shape == (2 * (rows - 4), 3)  # vLLM's fused path
    else:
        assert model._fused_kv_weight is None and model._fused_kv_bias is None
