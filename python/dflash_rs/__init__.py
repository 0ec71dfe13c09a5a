"""dflash-rs: a Rust KV-cache block pool and scheduler for LLM serving engines.

Lookahead-aware allocation makes DFlash's K+1 draft query slots (and every other drafter's
lookahead) owned by the request that writes them, from the very first prefill on.
"""

from __future__ import annotations

from dflash_rs._core import (
    CachedRequestData,
    KVCacheManager,
    NewRequestData,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
    UpdateResult,
    __version__,
)
from dflash_rs.config import SPECULATIVE_METHODS, SchedulerConfig, SpeculativeConfig
from dflash_rs.errors import (
    ArgumentTypeError,
    DFlashRsError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantError,
    OutOfBlocksError,
    PromptTooLongError,
    SchedulerStateError,
    UnknownRequestError,
    UnsupportedFeatureError,
)
from dflash_rs.request import ModelRunnerOutput, Request

__all__ = [
    "SPECULATIVE_METHODS",
    "ArgumentTypeError",
    "CachedRequestData",
    "DFlashRsError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvariantError",
    "KVCacheManager",
    "ModelRunnerOutput",
    "NewRequestData",
    "OutOfBlocksError",
    "PromptTooLongError",
    "Request",
    "RequestOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStateError",
    "SpeculativeConfig",
    "UnknownRequestError",
    "UnsupportedFeatureError",
    "UpdateResult",
    "__version__",
]
