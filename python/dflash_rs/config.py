"""Scheduler and speculative-decoding configuration (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dflash_rs import _core
from dflash_rs._checks import as_int

__all__ = ["SPECULATIVE_METHODS", "SchedulerConfig", "SpeculativeConfig"]

#: Speculative methods and the lookahead slots each needs past the scheduled tokens, for K
#: speculative tokens (the authoritative table lives in the Rust core, `lookahead.rs`).
SPECULATIVE_METHODS = ("dflash", "eagle", "eagle3", "mtp", "draft_model", "ngram", "suffix")


#: The int fields; a numpy integer given for one is stored as a plain int.
_SPECULATIVE_INT_FIELDS = ("num_speculative_tokens",)
_SCHEDULER_INT_FIELDS = (
    "num_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "long_prefill_token_threshold",
    "draft_slots_per_request",
    "hash_lookahead_tokens",
    "max_loras",
    "local_prefill_interval",
)


def _store_plain_ints(config: object, names: tuple[str, ...]) -> None:
    """Stores numpy integers given for int fields of a frozen config as ints (anything else
    stays as given, for the native check to accept or refuse)."""
    for name in names:
        value = getattr(config, name)
        if type(value) is not int:
            plain = as_int(value)
            if plain is not None:
                object.__setattr__(config, name, plain)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: the drafting method and K, its number of speculative tokens."""

    method: str
    num_speculative_tokens: int

    def __post_init__(self) -> None:
        _store_plain_ints(self, _SPECULATIVE_INT_FIELDS)
        _core._check_speculative_config(self)


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
    ``2**31 - 1`` (block ids and positions are int32 on the model side); or when the tables a
    scheduler allocates up front (the block table and the per-block tables) would exceed the
    machine's memory. The checks are the native module's: the constructor runs them, and a
    ``Scheduler`` runs the same ones on any config object it is given.
    ``pool_must_hold_max_model_len=False`` accepts the small pool, as vLLM's ``Scheduler`` class
    does (the vLLM drop-in sets it): a request that outgrows it alone is then ended with finish
    reason ``"error"``, reported by ``update_from_output``.

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
        # One validator, the native one, for these and for any duck-typed config a Scheduler
        # is given: the same checks and messages either way.
        _store_plain_ints(self, _SCHEDULER_INT_FIELDS)
        _core._check_scheduler_config(self)

    @property
    def spec_method(self) -> str:
        return "none" if self.speculative is None else self.speculative.method

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens
