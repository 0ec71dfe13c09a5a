"""vLLM ``Request`` objects: admission into the Rust core, and the state kept on them.

The engine hands each ``Request`` to the scheduler, which owns it from then on. vLLM 0.33's
engine core reads only ``request_id``, ``client_index`` and the status of the requests that
``finish_requests`` returns; the worker sees ``NewRequestData``/``CachedRequestData`` built from
the Rust core's output. So the per-step progress (``num_computed_tokens``, output tokens) stays
in Rust and is not copied onto the ``Request`` every step. What changes rarely is kept in sync
as it happens: ``status``, ``num_preemptions``, ``stop_reason``, events (with ``log_stats``),
``prefill_stats``, and ``num_computed_tokens`` at admission and preemption.
"""

from __future__ import annotations

from typing import Any, Optional

from dflash_rs.request import Request as CoreRequest

__all__ = ["RequestBook", "core_request", "unsupported_reason"]


def unsupported_reason(request: Any) -> Optional[str]:
    """Why dflash-rs cannot serve this request, or None. Checked at ``add_request``."""
    params = request.sampling_params
    if request.pooling_params is not None or params is None:
        return "pooling requests are not supported"
    if request.mm_features:
        return "multimodal inputs are not supported"
    if request.prompt_embeds is None and request.prompt_token_ids is None:
        return "a prompt needs token ids or embeddings"
    if request.resumable:
        return "streaming-input sessions are not supported"
    if getattr(params, "repetition_detection", None) is not None:
        return "repetition detection is not supported"
    return None


def lora_hash_key(lora_request: Any) -> Optional[str]:
    """What keys a LoRA request's blocks in the prefix cache: the adapter's name and path, as
    vLLM's block hashes (``_gen_lora_extra_hash_keys``, 0.32 and 0.33), so an adapter re-pointed
    at another path shares no KV with the old one."""
    if lora_request is None:
        return None
    return repr((lora_request.lora_name, lora_request.lora_path))


def core_request(request: Any, block_size: int) -> CoreRequest:
    """The dflash-rs request for a vLLM ``Request`` (stop rules from its SamplingParams);
    ``block_size`` is the prefix cache's (a prompt of embeddings is hashed per block)."""
    params = request.sampling_params
    lora = request.lora_request
    prompt, embed_hashes = request.prompt_token_ids, None
    if request.prompt_embeds is not None:
        prompt, embed_hashes = prompt_embeds_keys(request, block_size)
    return CoreRequest(
        request_id=request.request_id,
        prompt_token_ids=prompt,
        max_tokens=request.max_tokens,
        eos_token_id=params.eos_token_id,
        stop_token_ids=params.stop_token_ids or (),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        priority=request.priority,
        arrival_time=request.arrival_time,
        cache_salt=request.cache_salt,
        lora_name=lora_hash_key(lora),
        lora_id=lora.lora_int_id if lora is not None else None,
        skip_reading_prefix_cache=request.skip_reading_prefix_cache,
        prompt_embed_hashes=embed_hashes,
    )


def prompt_embeds_keys(request: Any, block_size: int) -> tuple[list[int], list[bytes]]:
    """A prompt given as embeddings: the tokens vLLM keeps for it (0 where an embedding stands)
    and the digest of each prompt block's embeddings, from vLLM's own block-hash key
    (``_gen_prompt_embeds_extra_hash_keys``, memoised on the request)."""
    from vllm.v1.core.kv_cache_utils import _gen_prompt_embeds_extra_hash_keys

    n = request.num_prompt_tokens
    digests = [
        _gen_prompt_embeds_extra_hash_keys(request, start, start + block_size)[0][1]
        for start in range(0, n, block_size)
    ]
    return list(request.all_token_ids[:n]), digests


class RequestBook:
    """The live vLLM ``Request`` objects and the little per-request state the adapter needs."""

    def __init__(self, log_stats: bool, block_size: int, caching: bool) -> None:
        from vllm.v1.engine import EngineCoreEventType
        from vllm.v1.request import RequestStatus

        self.log_stats = log_stats
        self.block_size = block_size
        self.caching = caching
        self.Status = RequestStatus
        self.Event = EngineCoreEventType
        #: Live requests (waiting, running or preempted), by id.
        self.requests: dict[str, Any] = {}
        #: Requests with events to attach to their next output.
        self.with_events: set[str] = set()
        #: Requests that have not emitted an output yet (their prefill stats are pending).
        self.no_output_yet: set[str] = set()
        #: Requests whose every output needs the slow path (logprobs, trace headers).
        self.always_slow: set[str] = set()
        #: Requests whose next output needs more than its tokens (events, prefill stats,
        #: logprobs, trace headers): the union of the sets above.
        self.slow_path: set[str] = set()
        #: Requests with a client index other than 0.
        self.num_other_clients = 0
        #: With KV-cache events: requests finished since the events were last collected (their
        #: last registered blocks still need the request). None without events.
        self.recently_finished: Optional[dict[str, Any]] = None
        #: Requests whose prompt logprobs the runner returned with the output being applied.
        self.prompt_logprobs_due: set[str] = set()
        #: The scheduler's structured-output requests (``_structured.StructuredOutputs``).
        self.structured: Any = None

    def add(self, request: Any) -> None:
        rid = request.request_id
        self.requests[rid] = request
        self.no_output_yet.add(rid)
        self.slow_path.add(rid)
        if request.sampling_params.num_logprobs is not None or request.trace_headers:
            self.always_slow.add(rid)
        if request.client_index:
            self.num_other_clients += 1
        if self.log_stats:
            request.record_event(self.Event.QUEUED)
            self.with_events.add(rid)

    def refresh_slow_path(self, rid: str) -> None:
        """After an output: whether the request's next one still needs the slow path."""
        if rid not in self.with_events and rid not in self.no_output_yet:
            if rid not in self.always_slow and rid not in self.prompt_logprobs_due:
                self.slow_path.discard(rid)

    def deliver_prompt_logprobs(self, prompt_logprobs: Any, token_id_logprobs: Any) -> None:
        """The runner returned prompt logprobs (``ModelRunnerOutput.prompt_logprobs_dict``,
        None while a prompt is still in chunks; ``prompt_token_id_logprobs_dict``): their
        requests' outputs of this step carry them, so they take the slow path for it."""
        due = [rid for rid, lp in prompt_logprobs.items() if lp is not None]
        due.extend(token_id_logprobs)
        self.prompt_logprobs_due.clear()
        for rid in due:
            if rid in self.requests:
                self.prompt_logprobs_due.add(rid)
                self.slow_path.add(rid)

    def admitted(self, rid: str, num_computed_tokens: int, resumed: bool, now: float) -> None:
        """A waiting (or preempted) request was scheduled."""
        request = self.requests[rid]
        request.status = self.Status.RUNNING
        request.num_computed_tokens = num_computed_tokens
        if self.log_stats:
            request.record_event(self.Event.SCHEDULED, now)
            self.with_events.add(rid)
            self.slow_path.add(rid)
        if not resumed and request.prefill_stats is not None:
            request.prefill_stats.set(
                num_prompt_tokens=request.num_prompt_tokens,
                num_local_cached_tokens=num_computed_tokens,
                num_external_cached_tokens=0,
            )

    def preempted(self, rid: str, now: float) -> None:
        request = self.requests.get(rid)
        if request is None:
            return
        request.status = self.Status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.spec_token_ids:
            request.spec_token_ids = []
        if self.log_stats:
            request.record_event(self.Event.PREEMPTED, now)
            self.with_events.add(rid)
            self.slow_path.add(rid)

    def take_events(self, rid: str, request: Any) -> Any:
        if rid not in self.with_events:
            return None
        self.with_events.discard(rid)
        return request.take_events()

    def take_prefill_stats(self, rid: str, request: Any) -> Any:
        if rid not in self.no_output_yet:
            return None
        self.no_output_yet.discard(rid)
        stats = request.take_prefill_stats()
        if stats is not None:
            prompt = request.num_prompt_tokens
            cached = prompt // self.block_size * self.block_size if self.caching else 0
            stats.finalize(cached)
        return stats

    def finished(self, rid: str, status: Any, stop_reason: Optional[int] = None) -> Any:
        """Marks a live request finished and forgets it; returns it (None if unknown)."""
        request = self.requests.pop(rid, None)
        if request is None:
            return None
        request.status = status
        if stop_reason is not None:
            request.stop_reason = stop_reason
        self.no_output_yet.discard(rid)
        self.with_events.discard(rid)
        self.always_slow.discard(rid)
        self.prompt_logprobs_due.discard(rid)
        self.slow_path.discard(rid)
        if self.structured is not None and rid in self.structured.live:
            self.structured.forget(rid)
        if request.client_index:
            self.num_other_clients -= 1
        if self.recently_finished is not None:
            self.recently_finished[rid] = request
        return request
