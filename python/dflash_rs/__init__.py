"""dflash-rs: a Rust KV-cache block pool and scheduler for LLM serving engines.

Lookahead-aware allocation makes DFlash's K+1 draft query slots (and every other drafter's
lookahead) owned by the request that writes them, from the very first prefill on.
"""

from __future__ import annotations

from dflash_rs._core import KVCacheManager, __version__
from dflash_rs.errors import (
    DFlashRsError,
    DuplicateRequestError,
    InvalidArgumentError,
    InvariantError,
    OutOfBlocksError,
    PromptTooLongError,
    SchedulerStateError,
    UnknownRequestError,
)

__all__ = [
    "DFlashRsError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvariantError",
    "KVCacheManager",
    "OutOfBlocksError",
    "PromptTooLongError",
    "SchedulerStateError",
    "UnknownRequestError",
    "__version__",
]
