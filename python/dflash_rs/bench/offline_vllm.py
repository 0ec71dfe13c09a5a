"""Build vLLM's scheduler inputs offline: no GPU, no weights, no hub access.

For tests, benchmarks and trying the drop-in by hand. Mirrors how vLLM's own unit tests build a
scheduler (``tests/v1/core/utils.py``): the config.json-only model directories of
``offline_models`` (a tiny Llama target; EAGLE and DFlash drafts), a CPU ``DeviceConfig``, and
a ``KVCacheConfig`` of one full-attention group with the requested number of blocks (null block
included). Requests are built with the block hasher EngineCore uses. Structured outputs need a
tokenizer: ``configs(tokenizer=True)`` loads ``offline_models.write_tokenizer``'s, saved beside
the target's config.json.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from dflash_rs.bench.offline_models import write_model_dirs, write_tokenizer
from dflash_rs.vllm._compat import installed

__all__ = ["OfflineVllm"]


@dataclass
class OfflineVllm:
    """Factory of offline vLLM configs, schedulers and requests (vLLM imported on creation)."""

    root: str

    def __post_init__(self) -> None:
        import torch
        import vllm.config as vc
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self._torch = torch
        self._vc = vc
        self._SamplingParams = SamplingParams
        self._Request = Request
        self._get_hash_fn_by_name = get_hash_fn_by_name
        self._init_none_hash = init_none_hash
        self._kv = (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec)
        self._StructuredOutputManager = StructuredOutputManager
        self.dirs = write_model_dirs(self.root)

    def configs(
        self,
        *,
        num_blocks: int,
        method: str = "none",
        num_speculative_tokens: int = 3,
        block_size: int = 16,
        max_model_len: int = 4096,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        async_scheduling: bool = False,
        scheduler: Optional[dict[str, Any]] = None,
        speculative: Optional[dict[str, Any]] = None,
        parallel: Optional[dict[str, Any]] = None,
        vllm: Optional[dict[str, Any]] = None,
        kv_cache_groups: Optional[Sequence[Any]] = None,
        tokenizer: bool = False,
    ) -> tuple[Any, Any]:
        """``(VllmConfig, KVCacheConfig)`` for a tiny Llama with one full-attention group.

        ``scheduler``/``speculative``/``parallel``/``vllm`` hold extra keyword arguments of
        vLLM's ``SchedulerConfig``/``SpeculativeConfig``/``ParallelConfig``/``VllmConfig`` (e.g.
        ``scheduler={"prefill_schedule_interval": 4}``, ``parallel={"data_parallel_size": 2}``);
        ``kv_cache_groups`` replaces the single full-attention group; ``tokenizer`` loads
        ``write_tokenizer``'s tokenizer (written into the target's directory on first use),
        which structured outputs need.
        """
        vc = self._vc
        if tokenizer and not os.path.exists(os.path.join(self.dirs["target"], "tokenizer.json")):
            write_tokenizer(self.dirs["target"])
        model = vc.ModelConfig(
            model=self.dirs["target"],
            dtype="float16",
            seed=0,
            skip_tokenizer_init=not tokenizer,
            max_model_len=max_model_len,
        )
        parallel = vc.ParallelConfig(**(parallel or {}))
        spec = None
        if method != "none":
            spec = vc.SpeculativeConfig(
                method=method,
                num_speculative_tokens=num_speculative_tokens,
                model=self.dirs.get(method, method),
                target_model_config=model,
                target_parallel_config=parallel,
                **(speculative or {}),
            )
        cache = vc.CacheConfig(
            block_size=block_size,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=enable_prefix_caching,
        )
        config = vc.VllmConfig(
            model_config=model,
            cache_config=cache,
            parallel_config=parallel,
            scheduler_config=vc.SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=enable_chunked_prefill,
                policy=policy,
                async_scheduling=async_scheduling,
                is_encoder_decoder=model.is_encoder_decoder,
                **(scheduler or {}),
            ),
            speculative_config=spec,
            device_config=vc.DeviceConfig(device="cpu"),
            **(vllm or {}),
        )
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec = self._kv
        if kv_cache_groups is None:
            layer = FullAttentionSpec(
                block_size=block_size, num_kv_heads=1, head_size=1, dtype=self._torch.float32
            )
            kv_cache_groups = [KVCacheGroupSpec(["layer"], layer)]
        kv_config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=list(kv_cache_groups)
        )
        cache.num_gpu_blocks = num_blocks
        return config, kv_config

    def scheduler(
        self, cls: type, vllm_config: Any, kv_cache_config: Any, log_stats: bool = True
    ) -> Any:
        """``cls`` built with the keyword arguments EngineCore passes."""
        block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
        return cls(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=self._StructuredOutputManager(vllm_config),
            include_finished_set=False,
            log_stats=log_stats,
            block_size=block_size,
            hash_block_size=block_size,
        )

    def block_hasher(self, vllm_config: Any) -> Callable[[Any], list[Any]]:
        """The request block hasher EngineCore builds for ``vllm_config``."""
        cache = vllm_config.cache_config
        hash_fn = self._get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        self._init_none_hash(hash_fn)
        return installed().request_block_hasher(cache.block_size, hash_fn, vllm_config)

    def request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        hasher: Optional[Callable[[Any], list[Any]]] = None,
        **sampling: Any,
    ) -> Any:
        """A vLLM ``Request``; ``sampling`` holds extra ``SamplingParams`` arguments, plus
        ``priority``, ``arrival_time``, ``client_index``, ``lora_request``, ``cache_salt`` and
        ``prompt_embeds`` (for the request) and ``eos_token_id`` (set as the engine's input
        processor does)."""
        keys = (
            "priority",
            "arrival_time",
            "client_index",
            "lora_request",
            "cache_salt",
            "prompt_embeds",
        )
        extra = {k: sampling.pop(k) for k in keys if k in sampling}
        eos = sampling.pop("eos_token_id", None)
        params = self._SamplingParams(max_tokens=max_tokens, **sampling)
        if eos is not None:
            params.update_from_generation_config({}, eos)
        return self._Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
            **extra,
        )
