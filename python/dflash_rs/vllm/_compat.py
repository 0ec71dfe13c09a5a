"""The vLLM release series the drop-in supports, and what differs between them.

Everything in ``dflash_rs.vllm`` that depends on vLLM's version reads it from the one
``VllmSeries`` that ``installed()`` returns, keyed on ``vllm.__version__``; nothing else probes
vLLM with ``hasattr``. Differences between 0.32 and 0.33 that the drop-in sees (checked against
both wheels):

- ``SchedulerInterface.has_request`` is new in 0.33 (defined here for both);
- ``SchedulerOutput`` gains ``skip_drafts`` and ``encoder_input_updates`` in 0.33 (both have
  defaults that mean "nothing to skip or update", which is what the drop-in hands out);
- ``EngineCoreOutput.error`` (a ``RequestError`` with the reason a request failed) is new in 0.33;
- ``VllmConfig.num_hash_lookahead_tokens`` and ``BlockStored.lookahead_token_ids`` are new in 0.33
  (0.32 has no lookahead hashes: it is 0 there);
- ``AsyncScheduler._update_request_with_output`` moved into the base ``Scheduler`` in 0.33;
- DFlash's ``max_num_new_slots_for_drafting`` is K in 0.32 and 0 in 0.33: in 0.32 every request
  scheduled in a step also takes K input slots of the step's token budget;
- with the priority policy, a running request that preempts itself ends the running phase in
  0.32 and lets the requests after it be tried in 0.33;
- 0.33 caches the full blocks of a request that stops with speculative decoding or output
  placeholders before freeing them; 0.32 does not.
- both hold prefills back on the steps the data-parallel engine core throttles
  (``schedule(throttle_prefills=True)``); only 0.33 also applies ``prefill_schedule_interval``
  locally, in a scheduler whose ``data_parallel_size`` is 1 (0.32's scheduler ignores it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from dflash_rs.errors import UnsupportedFeatureError

__all__ = ["SUPPORTED_SERIES", "VllmSeries", "installed", "series_of"]

#: The vLLM release series the drop-in is written and tested against, oldest first.
SUPPORTED_SERIES = ("0.32", "0.33")  # exported as dflash_rs.vllm.SUPPORTED_VLLM


@dataclass(frozen=True)
class VllmSeries:
    """What the drop-in must do differently for one vLLM release series."""

    #: ``vllm.__version__`` as installed.
    version: str
    #: Its release series, e.g. ``"0.33"``.
    name: str
    #: ``EngineCoreOutput`` takes ``error=RequestError(...)``.
    output_has_error: bool
    #: ``VllmConfig.num_hash_lookahead_tokens`` exists (else there are no lookahead hashes).
    has_hash_lookahead_tokens: bool
    #: A config for the V2 model runner can be built without a GPU (0.32 refuses it unless
    #: Triton has an active GPU driver): what the scheduler-level tests can cover here.
    v2_runner_without_gpu: bool
    #: The scheduler applies ``prefill_schedule_interval`` itself when not DP-coordinated.
    has_local_prefill_cadence: bool

    def num_hash_lookahead_tokens(self, vllm_config: Any) -> int:
        """vLLM's lookahead hash length (0 where the series has none)."""
        return vllm_config.num_hash_lookahead_tokens if self.has_hash_lookahead_tokens else 0

    def local_prefill_interval(self, vllm_config: Any) -> int:
        """vLLM's ``Scheduler.local_prefill_interval``: ``prefill_schedule_interval`` where the
        series has a local cadence and ``data_parallel_size`` is 1 (a DP engine core drives the
        cadence itself, through ``throttle_prefills``), else 1."""
        if not self.has_local_prefill_cadence:
            return 1
        if vllm_config.parallel_config.data_parallel_size != 1:
            return 1
        return vllm_config.scheduler_config.prefill_schedule_interval

    def request_block_hasher(self, block_size: int, hash_fn: Any, vllm_config: Any) -> Any:
        """The request block hasher EngineCore builds (``get_request_block_hasher``)."""
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher

        if self.has_hash_lookahead_tokens:
            lookahead = vllm_config.num_hash_lookahead_tokens
            return get_request_block_hasher(block_size, hash_fn, lookahead)
        return get_request_block_hasher(block_size, hash_fn)


_SERIES = {
    "0.32": dict(
        output_has_error=False,
        has_hash_lookahead_tokens=False,
        v2_runner_without_gpu=False,
        has_local_prefill_cadence=False,
    ),
    "0.33": dict(
        output_has_error=True,
        has_hash_lookahead_tokens=True,
        v2_runner_without_gpu=True,
        has_local_prefill_cadence=True,
    ),
}


def series_of(version: str) -> VllmSeries:
    """The series of a vLLM version string; ``UnsupportedFeatureError`` outside
    ``SUPPORTED_SERIES``."""
    name = ".".join(version.split("+")[0].split(".")[:2])
    facts = _SERIES.get(name)
    if facts is None:
        raise UnsupportedFeatureError(
            f"dflash_rs.vllm supports vLLM {' and '.join(SUPPORTED_SERIES)}, found {version}"
        )
    return VllmSeries(version=version, name=name, **facts)


@functools.cache
def installed() -> VllmSeries:
    """The installed vLLM's series (imports vLLM)."""
    import vllm

    return series_of(vllm.__version__)
