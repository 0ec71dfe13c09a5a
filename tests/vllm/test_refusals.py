"""Features vLLM has and dflash-rs does not (yet) are refused at construction, never ignored.

Each case builds a valid offline config, turns one feature on (through vLLM's own config
classes where that is cheap offline, otherwise by overriding the attribute the check reads) and
expects ``UnsupportedFeatureError`` naming the feature. Per-request features are refused at
``add_request`` with a final error output instead (the engine must keep serving the others).
"""

from __future__ import annotations

from typing import Any

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

import torch
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput

from dflash_rs.errors import DFlashRsError, UnsupportedFeatureError
from dflash_rs.vllm import DFlashRsScheduler
from dflash_rs.vllm._compat import installed


class _Override:
    """``obj`` with some attributes replaced; everything else is read through."""

    def __init__(self, obj: Any, **values: Any) -> None:
        self.__dict__["_obj"] = obj
        self.__dict__.update(values)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_obj"], name)


def _override(obj: Any, path: str, value: Any) -> Any:
    head, _, rest = path.partition(".")
    if not rest:
        return _Override(obj, **{head: value})
    return _Override(obj, **{head: _override(getattr(obj, head), rest, value)})


def _build(offline: Any, cfg: Any, kv: Any) -> Any:
    return offline.scheduler(DFlashRsScheduler, cfg, kv)


def _full(block_size: int = 16) -> Any:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


# (vLLM config keyword arguments of OfflineVllm.configs, words the error must contain)
REAL_CONFIGS = [
    ({"scheduler": {"watermark": 0.1}}, "watermark"),
    ({"scheduler": {"scheduler_reserve_full_isl": False}}, "full-sequence"),
    (
        {
            "scheduler": {
                "long_prefill_token_threshold": 64,
                "long_prefill_token_threshold_adaptive": True,
            }
        },
        "adaptive",
    ),
    (
        {
            "method": "eagle",
            "speculative": {"num_speculative_tokens_per_batch_size": [(1, 256, 3)]},
        },
        "dynamic",
    ),
    (
        {"kv_cache_groups": [KVCacheGroupSpec(["a"], _full()), KVCacheGroupSpec(["b"], _full())]},
        "2 KV-cache groups",
    ),
    (
        {
            "kv_cache_groups": [
                KVCacheGroupSpec(
                    ["a"],
                    SlidingWindowSpec(
                        block_size=16,
                        num_kv_heads=1,
                        head_size=1,
                        dtype=torch.float32,
                        sliding_window=64,
                    ),
                )
            ]
        },
        "SlidingWindowSpec",
    ),
    (
        {
            "kv_cache_groups": [
                KVCacheGroupSpec(
                    ["a"],
                    FullAttentionSpec(
                        block_size=16,
                        num_kv_heads=1,
                        head_size=1,
                        dtype=torch.float32,
                        sliding_window=64,
                    ),
                )
            ]
        },
        "sliding-window",
    ),
    (
        {
            "kv_cache_groups": [
                KVCacheGroupSpec(
                    ["m"], MambaSpec(block_size=16, shapes=((1,),), dtypes=(torch.float32,))
                )
            ]
        },
        "MambaSpec",
    ),
]


def _real_id(case: Any) -> str:
    kwargs, words = case
    return f"{kwargs.get('method', '')}-{words.split()[0].strip('-')}".strip("-")


@pytest.mark.parametrize("kwargs,words", REAL_CONFIGS, ids=[_real_id(c) for c in REAL_CONFIGS])
def test_refused_config(offline: Any, kwargs: dict[str, Any], words: str) -> None:
    try:
        cfg, kv = offline.configs(num_blocks=64, **kwargs)
    except Exception as e:  # vLLM itself rejects the combination offline
        pytest.skip(f"vLLM cannot build this config offline: {e}")
    with pytest.raises(UnsupportedFeatureError, match=words) as info:
        _build(offline, cfg, kv)
    assert isinstance(info.value, (DFlashRsError, NotImplementedError))


# (attribute path in VllmConfig, value, words the error must contain)
OVERRIDES = [
    ("kv_transfer_config", object(), "KV connectors"),
    ("ec_transfer_config", object(), "encoder-cache connectors"),
    ("model_config.is_multimodal_model", True, "multimodal"),
    ("model_config.is_encoder_decoder", True, "encoder-decoder"),
    ("model_config.runner_type", "pooling", "pooling"),
    ("parallel_config.pipeline_parallel_size", 2, "pipeline parallelism"),
    ("parallel_config.decode_context_parallel_size", 2, "context parallelism"),
    ("scheduler_config.max_num_scheduled_tokens", 100, "max_num_scheduled_tokens"),
    ("scheduler_config.policy", "lottery", "lottery"),
    ("cache_config.prefix_caching_hash_algo", "md5", "md5"),
    ("observability_config.kv_cache_metrics", True, "residency"),
    ("observability_config.per_request_spec_decode_metrics", "summary", "per-request"),
]


@pytest.mark.parametrize(
    "path,value,words", OVERRIDES, ids=[o[0].split(".")[-1] for o in OVERRIDES]
)
def test_refused_override(offline: Any, path: str, value: Any, words: str) -> None:
    cfg, kv = offline.configs(num_blocks=64)
    with pytest.raises(UnsupportedFeatureError, match=words):
        _build(offline, _override(cfg, path, value), kv)


@pytest.mark.parametrize("method", ["dspark", "draft_model", "ngram_gpu", "custom_class"])
def test_refused_speculative_method(offline: Any, method: str) -> None:
    cfg, kv = offline.configs(num_blocks=64, method="ngram")
    spec = _override(cfg.speculative_config, "method", method)
    with pytest.raises(UnsupportedFeatureError, match=method):
        _build(offline, _Override(cfg, speculative_config=spec), kv)


def test_refused_block_sizes(offline: Any) -> None:
    cfg, kv = offline.configs(num_blocks=64)
    from vllm.v1.structured_output import StructuredOutputManager

    with pytest.raises(UnsupportedFeatureError, match="block size"):
        DFlashRsScheduler(
            vllm_config=cfg,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(cfg),
            block_size=16,
            hash_block_size=8,
        )


def test_vllm_builds_what_we_refuse(offline: Any) -> None:
    """Sanity: the refusals are ours, not vLLM's (its own Scheduler takes the same config)."""
    cfg, kv = offline.configs(num_blocks=64, scheduler={"watermark": 0.1})
    offline.scheduler(Scheduler, cfg, kv)


# ---------------------------------------------------------------- per-request refusals


def _reasoning_structured(offline: Any) -> tuple[Any, Any]:
    """A structured-output request on an engine with a reasoning parser (without
    ``enable_in_reasoning``): the manager would read the request's token history."""
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    so_config = StructuredOutputsConfig(backend="xgrammar", reasoning_parser="deepseek_r1")
    cfg, kv = offline.configs(
        num_blocks=64, tokenizer=True, vllm={"structured_outputs_config": so_config}
    )
    scheduler = offline.scheduler(DFlashRsScheduler, cfg, kv)
    params = StructuredOutputsParams(json={"type": "object"})
    params._backend = "xgrammar"
    request = offline.request("so", [20] * 20, 4, structured_outputs=params)
    scheduler.structured_output_manager.grammar_init(request)
    return scheduler, request


@pytest.mark.filterwarnings("ignore:max_rollback_tokens is deprecated:DeprecationWarning")
@pytest.mark.parametrize(
    "make,words",
    [
        (_reasoning_structured, "enable_in_reasoning"),
    ],
    ids=["structured-outputs-with-reasoning-parser"],
)
def test_refused_request(offline: Any, make: Any, words: str) -> None:
    scheduler, request = make(offline)
    scheduler.add_request(request)
    scheduler.add_request(offline.request("ok", [21] * 20, 2))
    assert scheduler.has_requests() and not scheduler.has_request(request.request_id)
    out = scheduler.schedule()
    assert set(out.num_scheduled_tokens) == {"ok"}
    runner = ModelRunnerOutput(req_ids=["ok"], req_id_to_index={"ok": 0}, sampled_token_ids=[[30]])
    eco = scheduler.update_from_output(out, runner)[0]
    by_id = {o.request_id: o for o in eco.outputs}
    refused = by_id[request.request_id]
    assert refused.finish_reason == FinishReason.ERROR and refused.new_token_ids == []
    if installed().output_has_error:  # EngineCoreOutput.error is new in vLLM 0.33
        assert words in refused.error.message and refused.error.code == "validation_error"
    assert by_id["ok"].new_token_ids == [30]
