"""vLLM's constructor arguments -> a dflash-rs ``SchedulerConfig``, refusing what we lack.

Every vLLM feature the Rust core does not implement raises ``UnsupportedFeatureError`` here, at
construction, with the vLLM option that turns it off. Nothing is silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dflash_rs.config import SchedulerConfig, SpeculativeConfig
from dflash_rs.errors import UnsupportedFeatureError
from dflash_rs.vllm._compat import installed

__all__ = ["Translated", "kv_events_enabled", "translate_config"]

# vLLM speculative method -> dflash-rs method. Missing: dspark, ngram_gpu, draft_model (it
# needs extra query slots per request, `max_num_new_slots_for_drafting`), custom_class and
# extract_hidden_states.
_SPEC_METHODS = {
    "ngram": "ngram",
    "suffix": "suffix",
    "eagle": "eagle",
    "eagle3": "eagle3",
    "mtp": "mtp",
    "dflash": "dflash",
}
# vLLM prefix-caching hash -> dflash-rs block hash. The choice only matters for collisions;
# block ids and prefix hits are the same with any of them.
_HASH_ALGOS = {
    "sha256": "sha256",
    "sha256_cbor": "sha256",
    "xxhash": "xxh3_128",
    "xxhash_cbor": "xxh3_128",
}


@dataclass(frozen=True)
class Translated:
    """The dflash-rs config and the vLLM-side facts the adapter needs per step."""

    config: SchedulerConfig
    #: vLLM's `num_speculative_tokens` (K), 0 without speculative decoding.
    num_spec_tokens: int
    #: Resumed requests go to `scheduled_new_reqs` with their tokens (V2 model runner) or to
    #: `scheduled_cached_reqs.resumed_req_ids` (V1).
    use_v2_model_runner: bool
    block_size: int
    #: The engine schedules a step before the previous one's output arrives.
    async_scheduling: bool


def _refuse(feature: str, how: str) -> UnsupportedFeatureError:
    return UnsupportedFeatureError(
        f"dflash_rs.vllm.DFlashRsScheduler does not support {feature} yet; {how}"
    )


def _check_kv_cache_config(
    kv_cache_config: Any, block_size: int, hash_block_size: Optional[int]
) -> None:
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MLAAttentionSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise _refuse(
            f"{len(groups)} KV-cache groups (hybrid models: sliding window, Mamba, "
            "cross-attention, ...)",
            "only models with one full-attention KV-cache group can be served",
        )
    spec = groups[0].kv_cache_spec
    specs = (
        list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
    )
    for s in specs:
        if type(s) not in (FullAttentionSpec, MLAAttentionSpec):
            raise _refuse(
                f"KV-cache spec {type(s).__name__}",
                "only full attention (FullAttentionSpec, MLAAttentionSpec) is supported",
            )
        if s.sliding_window is not None or s.attention_chunk_size is not None:
            raise _refuse(
                "sliding-window or chunked-local attention",
                "only full attention is supported",
            )
        if getattr(s, "prefix_replay_tokens", 0):
            raise _refuse("prefix replay (SWA bounded replay)", "use a full-attention model")
    if spec.block_size != block_size or hash_block_size not in (None, block_size):
        raise _refuse(
            f"different block sizes (KV spec {spec.block_size}, scheduler {block_size}, "
            f"hash {hash_block_size})",
            "use one block size (no partial-block prefix hits)",
        )
    if kv_cache_config.needs_kv_cache_zeroing:
        raise _refuse("KV-cache block zeroing (mixed precision or Mamba)", "use one KV dtype")
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        raise _refuse("KVCacheConfig.hisparse_host_num_blocks", "leave it unset")
    # The engine sets 0 by default (only semantic checkpoints); with full attention alone
    # retention has no effect, and vLLM itself rejects any other value for such models.
    if getattr(kv_cache_config, "prefix_cache_retention_interval", None) not in (None, 0):
        raise _refuse("KVCacheConfig.prefix_cache_retention_interval", "leave it at 0")
    if getattr(kv_cache_config, "cache_hit_alignment_tokens", None) not in (None, block_size):
        raise _refuse("prefix hits aligned to other than the block size", "leave it unset")


def _speculative(vllm_config: Any) -> Optional[SpeculativeConfig]:
    spec = vllm_config.speculative_config
    if spec is None:
        if vllm_config.num_speculative_tokens:
            raise _refuse("diffusion canvases", "serve an autoregressive model")
        return None
    method = _SPEC_METHODS.get(spec.method)
    if method is None:
        raise _refuse(
            f"speculative method {spec.method!r}",
            f"use one of {', '.join(sorted(_SPEC_METHODS))}",
        )
    if spec.num_speculative_tokens_per_batch_size:
        raise _refuse(
            "dynamic speculative decoding (num_speculative_tokens_per_batch_size)",
            "use a fixed num_speculative_tokens",
        )
    if spec.max_num_new_slots_for_drafting and method != "dflash":
        # DFlash's slots (K in vLLM 0.32) only count against the token budget, which the
        # core charges (``draft_slots_per_request``); P-EAGLE's also widen the lookahead.
        raise _refuse(
            "drafters that add query slots per request (parallel EAGLE)",
            "use a drafter without extra query slots",
        )
    if spec.use_multi_module_mtp():
        raise _refuse(
            "multi-module MTP (prefill lookahead > 1)", "use num_speculative_tokens=1 with MTP"
        )
    return SpeculativeConfig(method, spec.num_speculative_tokens)


def _drops_last_hit_block(vllm_config: Any) -> bool:
    """vLLM's EAGLE block drop: the last block of every prefix-cache hit is recomputed (its
    default for EAGLE/EAGLE3/MTP without lookahead hashes, and for DFlash in 0.32, unless
    disable_eagle_block_drop)."""
    spec = vllm_config.speculative_config
    return (
        spec is not None
        and bool(spec.use_eagle_block_drop())
        and not installed().num_hash_lookahead_tokens(vllm_config)
    )


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether ``--kv-events-config`` turns KV-cache events on."""
    config = vllm_config.kv_events_config
    return config is not None and bool(config.enable_kv_cache_events)


def _check_engine(vllm_config: Any) -> None:
    model = vllm_config.model_config
    sched = vllm_config.scheduler_config
    parallel = vllm_config.parallel_config
    refusals = [
        (vllm_config.kv_transfer_config is not None, "KV connectors", "drop --kv-transfer-config"),
        (
            vllm_config.ec_transfer_config is not None,
            "encoder-cache connectors",
            "drop --ec-transfer-config",
        ),
        (
            model.is_multimodal_model or model.supports_multimodal_inputs,
            "multimodal encoders",
            "serve a text-only model",
        ),
        (model.is_encoder_decoder, "encoder-decoder models", "serve a decoder-only model"),
        (model.runner_type != "generate", "pooling models", "serve a generative model"),
        (getattr(model, "is_diffusion", False), "diffusion models", "serve an AR model"),
        (
            getattr(model, "return_sampling_mask", False),
            "sampling masks",
            "drop return_sampling_mask",
        ),
        (
            parallel.pipeline_parallel_size > 1,
            "pipeline parallelism",
            "use tensor parallelism (--pipeline-parallel-size 1)",
        ),
        (
            parallel.decode_context_parallel_size > 1 or parallel.prefill_context_parallel_size > 1,
            "context parallelism",
            "use --decode-context-parallel-size 1",
        ),
        (
            sched.max_num_scheduled_tokens not in (None, sched.max_num_batched_tokens),
            "max_num_scheduled_tokens != max_num_batched_tokens",
            "leave max_num_scheduled_tokens unset",
        ),
        (
            sched.long_prefill_token_threshold_adaptive,
            "an adaptive long-prefill threshold",
            "drop long_prefill_token_threshold_adaptive",
        ),
        (sched.watermark > 0, "a KV-cache watermark", "use watermark=0"),
        (
            not sched.scheduler_reserve_full_isl,
            "admission without the full-sequence check",
            "keep scheduler_reserve_full_isl=True",
        ),
        (
            vllm_config.observability_config.kv_cache_metrics,
            "KV-cache residency metrics",
            "drop --kv-cache-metrics",
        ),
        (
            vllm_config.observability_config.enable_mfu_metrics,
            "MFU metrics",
            "drop --enable-mfu-metrics",
        ),
        (
            vllm_config.observability_config.per_request_spec_decode_metrics != "none",
            "per-request speculative-decoding metrics",
            "leave per_request_spec_decode_metrics at 'none'",
        ),
        (
            getattr(vllm_config.attention_config, "hisparse_config", None) is not None,
            "HiSparse attention",
            "drop the HiSparse config",
        ),
        (vllm_config.is_mm_encoder_only, "encoder-only instances", "serve a decoder"),
        (
            getattr(vllm_config.aux_output_config, "enabled", False),
            "auxiliary output connectors",
            "disable aux outputs",
        ),
    ]
    for refused, feature, how in refusals:
        if refused:
            raise _refuse(feature, how)
    if sched.policy not in ("fcfs", "priority"):
        raise _refuse(f"scheduling policy {sched.policy!r}", "use fcfs or priority")
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo not in _HASH_ALGOS:
        raise _refuse(f"prefix-caching hash {algo!r}", f"use one of {', '.join(_HASH_ALGOS)}")


def translate_config(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: Optional[int],
) -> Translated:
    """Checks vLLM's configuration and builds the dflash-rs one; raises
    ``UnsupportedFeatureError`` for anything the Rust core does not implement."""
    _check_engine(vllm_config)
    _check_kv_cache_config(kv_cache_config, block_size, hash_block_size)
    speculative = _speculative(vllm_config)
    sched = vllm_config.scheduler_config
    cache = vllm_config.cache_config
    config = SchedulerConfig(
        num_blocks=kv_cache_config.num_blocks,
        block_size=block_size,
        max_model_len=vllm_config.model_config.max_model_len,
        # vLLM admits at most max_num_active_seqs requests (DFlash lowers it to fit its draft
        # pass in the token budget); max_num_seqs only sizes the model runner.
        max_num_seqs=sched.max_num_active_seqs or sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        long_prefill_token_threshold=sched.long_prefill_token_threshold,
        policy=sched.policy,
        speculative=speculative,
        hash_algo=_HASH_ALGOS[cache.prefix_caching_hash_algo],
        # vLLM 0.33 pads an admission with one token left to a uniform 1 + K decode.
        pad_admitted_decodes=speculative is not None,
        # vLLM's AsyncScheduler semantics (output placeholders) when the engine overlaps steps.
        async_scheduling=bool(sched.async_scheduling),
        drop_last_hit_block=_drops_last_hit_block(vllm_config),
        # vLLM 0.33's default for EAGLE-style drafters with prefix caching: each block's hash
        # also covers the token after it (replacing the drop).
        hash_lookahead_tokens=installed().num_hash_lookahead_tokens(vllm_config),
        kv_events=kv_events_enabled(vllm_config),
        # vLLM's Scheduler accepts a pool smaller than one max_model_len request (its engine
        # too, with num_gpu_blocks_override); such a request is ended with an error instead.
        pool_must_hold_max_model_len=False,
        # vLLM's Scheduler returns an empty step whatever is in flight; its engine decides.
        refuse_idle_steps=False,
        vllm_semantics=installed().name,
        draft_slots_per_request=(
            vllm_config.speculative_config.max_num_new_slots_for_drafting if speculative else 0
        ),
        # vLLM's limit on the adapters of one step's requests (none without LoRA).
        max_loras=vllm_config.lora_config.max_loras if vllm_config.lora_config else 0,
        # vLLM 0.33's local prefill cadence (1 on 0.32, and under DP coordination, where the
        # engine core throttles through schedule(throttle_prefills=True) instead).
        local_prefill_interval=installed().local_prefill_interval(vllm_config),
    )
    return Translated(
        config=config,
        num_spec_tokens=vllm_config.num_speculative_tokens,
        use_v2_model_runner=bool(vllm_config.use_v2_model_runner),
        block_size=block_size,
        async_scheduling=config.async_scheduling,
    )
