"""What an engine submits to the scheduler, and what the model runner reports back."""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dflash_rs._checks import INT64_MAX, INT64_MIN, as_int, checked_int
from dflash_rs.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ModelRunnerOutput", "Request"]

_MAX_TOKEN_ID = 2**31 - 1
_now = time.time


def _check_token(name: str, value: Any) -> int:
    checked = as_int(value)
    if checked is None:
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= checked <= _MAX_TOKEN_ID:
        raise InvalidArgumentError(f"{name} = {checked} is outside [0, 2**31 - 1]")
    return checked


@dataclass
class Request:
    """One generation request. ``prompt_token_ids`` may be a list or a 1-D integer array (any
    integer dtype); its values are checked when the scheduler admits it (in Rust, without a
    Python loop). Int fields take numpy integers too (stored as ints), never bools.

    ``lora_name`` keys the request's blocks in the prefix cache (with ``cache_salt``);
    ``lora_id`` (>= 1) identifies its adapter for ``SchedulerConfig.max_loras``.
    ``skip_reading_prefix_cache`` reads no prefix-cache hit for it (vLLM sets it for prompt
    logprobs, which need every prompt position computed); its blocks are still cached.
    ``prompt_embed_hashes`` is for prompts given as embeddings (their ``prompt_token_ids`` are
    placeholders): one 32-byte digest of each prompt block's embeddings, part of that block's
    hash, so prompts share prefix-cache blocks only where their embeddings agree."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    eos_token_id: Optional[int] = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    arrival_time: Optional[float] = None
    lora_name: Optional[str] = None
    cache_salt: Optional[str] = None
    lora_id: Optional[int] = None
    skip_reading_prefix_cache: bool = False
    prompt_embed_hashes: Optional[Sequence[bytes]] = None

    def __post_init__(self) -> None:
        # Each check takes its fast path (exact types, in range) first and the full check,
        # with its message, only when that fails: a Request is made per admission.
        if not isinstance(self.request_id, str):
            raise ArgumentTypeError(
                f"request_id must be a non-empty string, got {type(self.request_id).__name__}"
            )
        if not self.request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        value = self.max_tokens
        if type(value) is not int or not 1 <= value <= INT64_MAX:
            self.max_tokens = checked_int("max_tokens", value, 1)
        value = self.min_tokens
        if type(value) is not int or not 0 <= value <= INT64_MAX:
            self.min_tokens = checked_int("min_tokens", value, 0)
        if self.min_tokens > self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        value = self.priority
        if type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
            self.priority = checked_int("priority", value, INT64_MIN)
        if self.ignore_eos is not False and self.ignore_eos is not True:
            raise ArgumentTypeError(
                f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}"
            )
        if self.eos_token_id is not None:
            self.eos_token_id = _check_token("eos_token_id", self.eos_token_id)
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ArgumentTypeError(
                "stop_token_ids must be a sequence of ints, got "
                f"{type(self.stop_token_ids).__name__}"
            ) from None
        if stop:
            stop = tuple(_check_token("stop_token_ids[...]", t) for t in stop)
        self.stop_token_ids = stop
        arrival = self.arrival_time
        if arrival is None:
            self.arrival_time = _now()
        elif isinstance(arrival, bool) or not isinstance(arrival, numbers.Real):
            raise ArgumentTypeError(
                f"arrival_time must be a number or None, got {type(arrival).__name__}"
            )
        elif not math.isfinite(arrival):
            raise InvalidArgumentError(f"arrival_time must be finite, got {arrival}")
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise ArgumentTypeError("lora_name must be a str or None")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ArgumentTypeError("cache_salt must be a str or None")
        if self.lora_id is not None:
            self.lora_id = checked_int("lora_id", self.lora_id, 1)
            if self.lora_id > _MAX_TOKEN_ID:
                raise InvalidArgumentError(f"lora_id = {self.lora_id} is above 2**31 - 1")
        skip = self.skip_reading_prefix_cache
        if skip is not False and skip is not True:
            raise ArgumentTypeError(
                f"skip_reading_prefix_cache must be a bool, got {type(skip).__name__}"
            )


@dataclass
class ModelRunnerOutput:
    """The model's result for one scheduled step, in the step's batch order.

    ``sampled_token_ids[i]`` holds the accepted draft tokens plus the bonus token of request
    ``req_ids[i]`` (empty for a prefill chunk). For large batches pass flat arrays instead:
    ``ModelRunnerOutput.from_arrays(req_ids, tokens, counts)``, which costs no Python list per
    request. ``draft_token_ids`` (optional) holds the next step's drafts per request.
    """

    req_ids: Sequence[str]
    sampled_token_ids: Optional[Sequence[Sequence[int]]] = None
    draft_token_ids: Optional[Sequence[Sequence[int]]] = None
    sampled_tokens_flat: Any = field(default=None, repr=False)
    num_sampled_tokens: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        has_lists = self.sampled_token_ids is not None
        has_arrays = self.sampled_tokens_flat is not None or self.num_sampled_tokens is not None
        if has_lists == has_arrays:
            raise InvalidArgumentError(
                "give either sampled_token_ids or sampled_tokens_flat + num_sampled_tokens"
            )
        if has_arrays and (self.sampled_tokens_flat is None or self.num_sampled_tokens is None):
            raise InvalidArgumentError("sampled_tokens_flat and num_sampled_tokens go together")

    @classmethod
    def from_arrays(
        cls,
        req_ids: Sequence[str],
        sampled_tokens: Any,
        num_sampled_tokens: Any,
        draft_token_ids: Optional[Sequence[Sequence[int]]] = None,
    ) -> ModelRunnerOutput:
        """Flat ``sampled_tokens`` (a 1-D integer array, int32 or int64 read in place) with
        per-request ``num_sampled_tokens``."""
        return cls(
            req_ids,
            None,
            draft_token_ids,
            sampled_tokens_flat=sampled_tokens,
            num_sampled_tokens=num_sampled_tokens,
        )
