"""What an engine submits to the scheduler, and what the model runner reports back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from dflash_rs._checks import as_int
from dflash_rs._core import _check_request
from dflash_rs.errors import InvalidArgumentError

__all__ = ["ModelRunnerOutput", "Request"]

_now = time.time

#: The int fields; a numpy integer given for one is stored as a plain int.
_INT_FIELDS = ("max_tokens", "min_tokens", "priority", "eos_token_id", "lora_id")


@dataclass
class Request:
    """One generation request. ``prompt_token_ids`` may be a list or a 1-D integer array (any
    integer dtype); its values are checked when the scheduler admits it (in Rust, without a
    Python loop). The other fields are checked here, by the native validator that submission
    runs too (so a duck-typed request gets the same errors). Int fields take numpy integers
    (stored as ints), never bools.

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
        if self.arrival_time is None:
            self.arrival_time = _now()
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if type(value) is not int and value is not None:
                plain = as_int(value)  # a numpy integer is stored as an int
                if plain is not None:
                    setattr(self, name, plain)
        # One validator, the native one: the checks, and messages, of submission (which reads
        # the prompt's tokens, without a Python loop).
        _check_request(self)


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
