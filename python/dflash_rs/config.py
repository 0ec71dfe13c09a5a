"""Scheduler and speculative-decoding configuration (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dflash_rs._checks import checked_int
from dflash_rs.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["SPECULATIVE_METHODS", "SchedulerConfig", "SpeculativeConfig"]

#: Speculative methods and the lookahead slots each needs past the scheduled tokens, for K
#: speculative tokens (the authoritative table lives in the Rust core, `lookahead.rs`).
SPECULATIVE_METHODS = ("dflash", "eagle", "eagle3", "mtp", "draft_model", "ngram", "suffix")

_POLICIES = ("fcfs", "priority")
_VLLM_SEMANTICS = ("0.32", "0.33")
_LOOKAHEAD_POLICIES = ("correct", "legacy-first-prefill", "legacy-k")
_HASH_ALGOS = ("sha256", "blake3", "xxh3_128")


#: Block ids, token positions and counts reach the model runner as int32 (the block table,
#: ``query_start_loc``, ...), so the fields they derive from are bounded by it (the Rust core's
#: ``limits`` module, which also bounds the memory the tables take up front).
_INT32_MAX = 2**31 - 1
_INT32_FIELDS = (
    "num_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
)


def _check_int(config: object, name: str, minimum: int) -> None:
    """Checks the int field ``name`` of a frozen config; a numpy integer is stored as an int."""
    value = getattr(config, name)
    checked = checked_int(name, value, minimum)
    if checked is not value:
        object.__setattr__(config, name, checked)


def _check_int32(name: str, value: int) -> None:
    if value > _INT32_MAX:
        raise InvalidArgumentError(
            f"{name} ({value}) must be at most 2**31 - 1 = {_INT32_MAX}: block ids, token "
            "positions and counts reach the model runner as int32"
        )


def _check_pool(num_blocks: int, block_size: int, max_model_len: int) -> None:
    """As vLLM at startup: the pool must hold one request of ``max_model_len`` tokens alone
    (lookahead slots stop at ``max_model_len`` too), plus the null block."""
    blocks = -(-max_model_len // block_size)
    if num_blocks < blocks + 1:
        raise InvalidArgumentError(
            f"num_blocks ({num_blocks}) cannot hold one request of max_model_len "
            f"({max_model_len}) tokens: that needs cdiv({max_model_len}, block_size "
            f"{block_size}) = {blocks} blocks plus the null block, {blocks + 1} in all; raise "
            "num_blocks or lower max_model_len"
        )


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be a bool, got {type(value).__name__}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the drafting method and K, its number of speculative tokens."""

    method: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise InvalidArgumentError(
                f"unknown speculative method {self.method!r}; expected one of "
                f"{', '.join(SPECULATIVE_METHODS)}"
            )
        _check_int(self, "num_speculative_tokens", 1)
        if self.num_speculative_tokens > 64:
            raise InvalidArgumentError("num_speculative_tokens must be <= 64")


@dataclass(frozen=True)
class SchedulerConfig:
    """Pool size, limits and policies of a :class:`dflash_rs.Scheduler`.

    ``lookahead_policy`` exists for tests only: the legacy values reproduce lookahead bugs that
    real engines shipped (no lookahead on first prefill; K instead of K+1 for DFlash).
    ``verify_prefix_hits=False`` is a test switch too: it trusts a prefix-cache hit on its block
    hash alone, as vLLM does, instead of checking the block's tokens and prefix.
    ``pad_admitted_decodes=True`` follows vLLM 0.33: an admitted request with one token left to
    compute (a resume, a full prefix hit) joins a decode batch as 1 + K tokens with K
    placeholder drafts (``-1`` in ``scheduled_spec_decode_tokens``), keeping the batch uniform.
    ``async_scheduling=True`` follows vLLM's ``AsyncScheduler``: the next step may be scheduled
    before the previous step's output is applied. A request that samples in a step counts the
    tokens it will get as output placeholders and is scheduled again with K placeholder drafts
    (``-1``) that the model runner replaces with its own; outputs are applied in step order.
    ``draft_slots_per_request`` input slots are charged to the step's token budget for every
    scheduled request on top of its tokens (vLLM's ``max_num_new_slots_for_drafting``: K for
    DFlash in vLLM 0.32, 0 in 0.33); 0 by default. ``drop_last_hit_block=True`` gives back the
    last block of every prefix-cache hit so its tokens are recomputed (vLLM's EAGLE block drop,
    its default for EAGLE-style drafters, and for DFlash in 0.32). ``hash_lookahead_tokens=L``
    makes each block's hash also cover the ``L`` tokens after it, as vLLM 0.33 does by default
    for EAGLE, EAGLE3 and MTP with prefix caching (``num_hash_lookahead_tokens``): a block is
    hashed, cached and reusable only once those tokens exist, and a hit needs the same next
    tokens, so the drafter's KV at the block's last position is reused only where it is right.
    It replaces the drop (the two exclude each other); 0 by default. ``vllm_semantics`` names the
    vLLM release series (``"0.32"`` or ``"0.33"``) whose scheduler is followed where the two
    differ: when blocks are registered as outputs arrive, a stop's computed-token claim, and
    priority self-preemption. ``kv_events=True`` keeps a log of prefix-cache changes (blocks
    registered, evicted, the cache cleared) that ``Scheduler.take_kv_events()`` drains, for an
    engine to publish as KV-cache events; off by default (no cost).

    A config is refused (``InvalidArgumentError``) when its pool cannot hold one request of
    ``max_model_len`` tokens (``num_blocks >= cdiv(max_model_len, block_size) + 1``, the null
    block included), as vLLM's engine refuses it at startup; when a size field is above
    ``2**31 - 1`` (block ids and positions are int32 on the model side); or, when the scheduler
    is built, when the tables it allocates up front (the block table and the per-block tables)
    would exceed the machine's memory. ``pool_must_hold_max_model_len=False`` accepts the small
    pool, as vLLM's ``Scheduler`` class does (the vLLM drop-in sets it): a request that outgrows
    it alone is then ended with finish reason ``"error"``, reported by ``update_from_output``.

    ``schedule()`` raises ``SchedulerStateError`` when it would return an idle step while one
    step (sync) or two (async) await their output: nothing can run until an output is applied
    or the step abandoned (``abandon_step``). ``refuse_idle_steps=False`` returns the empty step
    instead, as vLLM's ``Scheduler`` class does (the vLLM drop-in sets it).

    ``max_loras`` caps the LoRA adapters (``Request.lora_id``) among one step's requests, as
    vLLM's ``max_loras`` does: a waiting request whose adapter would be one too many is passed
    over and keeps its place in the queue. 0 (the default) sets no limit.

    ``local_prefill_interval=N`` is vLLM 0.33's local prefill cadence (its
    ``prefill_schedule_interval`` without data-parallel coordination): while a running request
    decodes, prefills (chunks of running prompts, admissions with more than one token left) wait
    until N executed steps have passed since the last step that carried one, unless the last
    release left admissible requests waiting. ``Scheduler.schedule(throttle_prefills=True)`` (vLLM's
    DP throttle) holds them back the same way for one step. 1 (the default) holds nothing back.
    """

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 8192
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    speculative: Optional[SpeculativeConfig] = None
    hash_algo: str = "sha256"
    hash_seed: Optional[str] = None
    lookahead_policy: str = "correct"
    verify_prefix_hits: bool = True
    pad_admitted_decodes: bool = False
    async_scheduling: bool = False
    draft_slots_per_request: int = 0
    drop_last_hit_block: bool = False
    hash_lookahead_tokens: int = 0
    kv_events: bool = False
    vllm_semantics: str = "0.33"
    pool_must_hold_max_model_len: bool = True
    refuse_idle_steps: bool = True
    max_loras: int = 0
    local_prefill_interval: int = 1

    def __post_init__(self) -> None:
        _check_int(self, "num_blocks", 2)
        _check_int(self, "block_size", 1)
        _check_int(self, "max_model_len", 2)
        _check_int(self, "max_num_seqs", 1)
        _check_int(self, "max_num_batched_tokens", 1)
        _check_int(self, "long_prefill_token_threshold", 0)
        _check_int(self, "draft_slots_per_request", 0)
        _check_int(self, "hash_lookahead_tokens", 0)
        _check_int(self, "max_loras", 0)
        _check_int(self, "local_prefill_interval", 1)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        _check_bool("verify_prefix_hits", self.verify_prefix_hits)
        _check_bool("pad_admitted_decodes", self.pad_admitted_decodes)
        _check_bool("async_scheduling", self.async_scheduling)
        _check_bool("drop_last_hit_block", self.drop_last_hit_block)
        _check_bool("kv_events", self.kv_events)
        _check_bool("pool_must_hold_max_model_len", self.pool_must_hold_max_model_len)
        _check_bool("refuse_idle_steps", self.refuse_idle_steps)
        if self.hash_lookahead_tokens > 64:
            raise InvalidArgumentError(
                f"hash_lookahead_tokens must be at most 64, got {self.hash_lookahead_tokens}"
            )
        if self.hash_lookahead_tokens and self.drop_last_hit_block:
            raise InvalidArgumentError(
                "hash_lookahead_tokens and drop_last_hit_block exclude each other: lookahead "
                "hashes make the last hit block reusable, the drop recomputes it"
            )
        if self.vllm_semantics not in _VLLM_SEMANTICS:
            raise InvalidArgumentError(
                f"vllm_semantics must be '0.32' or '0.33', got {self.vllm_semantics!r}"
            )
        if self.policy not in _POLICIES:
            raise InvalidArgumentError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.hash_algo not in _HASH_ALGOS:
            raise InvalidArgumentError(
                f"hash_algo must be one of {', '.join(_HASH_ALGOS)}, got {self.hash_algo!r}"
            )
        if self.lookahead_policy not in _LOOKAHEAD_POLICIES:
            raise InvalidArgumentError(
                f"lookahead_policy must be one of {', '.join(_LOOKAHEAD_POLICIES)}, "
                f"got {self.lookahead_policy!r}"
            )
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise InvalidArgumentError("speculative must be a SpeculativeConfig or None")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise InvalidArgumentError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        for name in _INT32_FIELDS:
            _check_int32(name, getattr(self, name))
        if self.pool_must_hold_max_model_len:
            _check_pool(self.num_blocks, self.block_size, self.max_model_len)

    @property
    def spec_method(self) -> str:
        return "none" if self.speculative is None else self.speculative.method

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens
