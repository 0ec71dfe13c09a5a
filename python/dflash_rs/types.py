"""Types of the dflash-rs Python API, for annotations (the native module's stubs use them).

Everything here is plain typing: ``Literal`` aliases for the strings the API takes and returns,
and the ``TypedDict`` of :meth:`dflash_rs.Scheduler.stats`.
"""

from __future__ import annotations

from typing import Literal, TypedDict

__all__ = ["FinishReason", "FinishStatus", "PauseState", "RequestStatus", "SchedulerStats"]

#: Why a request finished (``RequestOutput.finish_reason``, ``UpdateResult.finish_reasons``).
FinishReason = Literal["stop", "length", "abort", "error"]

#: What ``Scheduler.finish_requests`` accepts as ``status``: the finish reasons and their vLLM
#: spellings.
FinishStatus = Literal[
    "abort",
    "aborted",
    "FINISHED_ABORTED",
    "stop",
    "stopped",
    "FINISHED_STOPPED",
    "length",
    "FINISHED_LENGTH_CAPPED",
    "error",
    "FINISHED_ERROR",
]

#: ``Scheduler.request_status`` of a live request.
RequestStatus = Literal["waiting", "running", "preempted", "finished"]

#: ``Scheduler.pause_state`` and what ``set_pause_state`` takes.
PauseState = Literal["unpaused", "paused_new", "paused_all"]


class SchedulerStats(TypedDict):
    """``Scheduler.stats()``: counters since the scheduler was built, and the pool's state."""

    num_steps: int
    num_preemptions: int
    num_finished: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_blocks: int
    #: Prefix-cache lookups: requests looked up, tokens queried, tokens hit (all admissions).
    prefix_cache_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    #: The same, first admissions only.
    prefix_cache_admitted_requests: int
    prefix_cache_admitted_queries: int
    prefix_cache_admitted_hits: int
    #: The same, resumptions after preemption only.
    prefix_cache_resumed_requests: int
    prefix_cache_resumed_queries: int
    prefix_cache_resumed_hits: int
    #: Speculative decoding: verification steps with drafts, draft tokens, accepted tokens.
    spec_num_drafts: int
    spec_num_draft_tokens: int
    spec_num_accepted_tokens: int
    spec_num_accepted_tokens_per_pos: list[int]
    spec_num_draft_tokens_per_pos: list[int]
    lookahead_tokens: int
