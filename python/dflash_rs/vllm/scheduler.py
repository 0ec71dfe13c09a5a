"""``DFlashRsScheduler``: vLLM 0.33's ``SchedulerInterface`` on top of the Rust core.

Select it with ``--scheduler-cls dflash_rs.vllm.DFlashRsScheduler``; with async scheduling
(vLLM's default) it follows vLLM's ``AsyncScheduler`` (output placeholders), otherwise its
``Scheduler``. Each engine step crosses into Rust once per call (``schedule``,
``update_from_output``, ``update_draft_token_ids``); Python only turns the Rust outputs into
vLLM's ``SchedulerOutput`` and ``EngineCoreOutputs``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Optional, Union

from vllm.multimodal import MULTIMODAL_REGISTRY, MultiModalRegistry
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import RequestStatus

from dflash_rs._core import Scheduler as CoreScheduler
from dflash_rs.errors import (
    InvalidArgumentError,
    OutOfBlocksError,
    PromptTooLongError,
    SchedulerStateError,
    UnsupportedFeatureError,
)
from dflash_rs.vllm._compat import installed
from dflash_rs.vllm._config import translate_config
from dflash_rs.vllm._kv_events import KvEvents, create_publisher
from dflash_rs.vllm._outputs import OutputBuilder
from dflash_rs.vllm._requests import RequestBook, core_request, unsupported_reason
from dflash_rs.vllm._structured import StructuredOutputs, structured_reason

__all__ = ["DFlashRsScheduler"]

logger = logging.getLogger(__name__)

#: vLLM's pause states -> the core's (which gates admission and scheduling the same way).
_CORE_PAUSE = {
    PauseState.UNPAUSED: "unpaused",
    PauseState.PAUSED_NEW: "paused_new",
    PauseState.PAUSED_ALL: "paused_all",
}

_STATUS_NAMES = {
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ERROR: "error",
}


class DFlashRsScheduler(SchedulerInterface):
    """vLLM scheduler whose per-step work (admission, prefix caching, allocation with the
    speculative method's lookahead, preemption, output application) runs in dflash-rs's Rust
    core. Unsupported vLLM features raise ``UnsupportedFeatureError`` here, at construction."""

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: Optional[int] = None,
        mm_registry: MultiModalRegistry = MULTIMODAL_REGISTRY,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        installed()  # another vLLM series is refused first, by name
        tr = translate_config(vllm_config, kv_cache_config, block_size, hash_block_size)
        self.vllm_config = vllm_config
        self.kv_cache_config = kv_cache_config
        self.structured_output_manager = structured_output_manager
        self.log_stats = log_stats
        self.block_size = block_size
        self.num_spec_tokens = tr.num_spec_tokens
        self.num_lookahead_tokens = vllm_config.num_lookahead_tokens
        self.core_config = tr.config
        self._core = CoreScheduler(tr.config)
        if self._core.required_lookahead_tokens != self.num_lookahead_tokens:
            raise UnsupportedFeatureError(
                f"vLLM reserves {self.num_lookahead_tokens} lookahead slots for "
                f"{tr.config.spec_method} with K={tr.num_spec_tokens}, dflash-rs "
                f"{self._core.required_lookahead_tokens}; this vLLM version is not supported"
            )
        self._book = RequestBook(log_stats, block_size, tr.config.enable_prefix_caching)
        self.async_scheduling = tr.async_scheduling
        self._out = OutputBuilder(
            self._core, self._book, tr.num_spec_tokens, tr.use_v2_model_runner, tr.async_scheduling
        )
        #: Structured outputs through vLLM's manager (hooks return at once while none is live).
        self._structured = StructuredOutputs(structured_output_manager, self._core, self.requests)
        self._book.structured = self._structured
        self._out.structured = self._structured
        #: vLLM's KV/EC connectors: refused at construction, so always None.
        self.connector = None
        self.ec_connector = None
        #: KV-cache events (``--kv-events-config``), through vLLM's publisher (as its Scheduler:
        #: a no-op one without events); ``_kv_events`` converts the core's log, None if off.
        self.kv_events_config = vllm_config.kv_events_config
        self.enable_kv_cache_events = tr.config.kv_events
        self.kv_event_publisher = create_publisher(vllm_config)
        self._kv_events: Optional[KvEvents] = None
        if self.enable_kv_cache_events:
            self._kv_events = KvEvents(
                self._core,
                self._book,
                vllm_config,
                kv_cache_config,
                block_size,
            )
        self._pause_state = PauseState.UNPAUSED
        #: Steps handed out and not yet given back to update_from_output: (vLLM, dflash-rs).
        self._in_flight: deque[tuple[Any, Any]] = deque()
        #: Requests finished since the last schedule() (what has_finished_requests reports).
        self._num_finished_unreported = 0
        #: Final outputs of requests refused at add_request or ended inside schedule().
        self._error_outputs: list[Any] = []
        self._finished_dict: Optional[dict[int, set[str]]] = {} if include_finished_set else None
        #: A prefix-cache reset since the last stats (vLLM's ``PrefixCacheStats.reset``).
        self._prefix_reset = False

    # ------------------------------------------------------------------ requests

    @property
    def requests(self) -> dict[str, Any]:
        """Live vLLM requests (waiting, running or preempted) by id, as in vLLM's Scheduler."""
        return self._book.requests

    def add_request(self, request: Any) -> None:
        reason = unsupported_reason(request)
        if reason is None and self._kv_events is not None:
            reason = _kv_events_reason(request)
        if reason is None and request.use_structured_output:
            reason = structured_reason(self.structured_output_manager, request)
        if reason is not None:
            self._refuse_request(request, reason)
            return
        try:
            self._core.add_request(core_request(request, self.block_size))
        except (PromptTooLongError, OutOfBlocksError, InvalidArgumentError) as e:
            # E.g. a prompt larger than the whole pool, which vLLM would queue forever.
            self._refuse_request(request, str(e))
            return
        self._book.add(request)
        if request.use_structured_output:
            self._structured.add(request)
            self._book.always_slow.add(request.request_id)  # its outputs advance its grammar

    def _refuse_request(self, request: Any, reason: str) -> None:
        """Ends a request at once: its final output (finish reason ``error``) goes out with the
        next ``update_from_output``, so the engine keeps serving the others."""
        logger.warning("dflash-rs refuses request %s: %s", request.request_id, reason)
        request.status = RequestStatus.FINISHED_ERROR
        output = self._out.error_output(request, f"dflash-rs: {reason}")
        self._error_outputs.append((request.client_index, output))

    def has_request(self, request_id: str) -> bool:
        return request_id in self._book.requests

    def finish_requests(
        self,
        request_ids: Union[str, Iterable[str], None],
        finished_status: RequestStatus,
    ) -> list[Any]:
        assert RequestStatus.is_finished(finished_status)
        if request_ids is None:
            ids = list(self._book.requests)
        elif isinstance(request_ids, str):
            ids = [request_ids]
        else:
            ids = list(dict.fromkeys(request_ids))
        name = _STATUS_NAMES.get(finished_status, "abort")
        done = self._core.finish_requests(ids, name)
        finished = []
        for rid in done:
            request = self._book.finished(rid, finished_status)
            if request is not None:
                finished.append(request)
                self._note_finished(request)
        return finished

    def _note_finished(self, request: Any) -> None:
        self._num_finished_unreported += 1
        if self._finished_dict is not None:
            self._finished_dict.setdefault(request.client_index, set()).add(request.request_id)

    def get_num_unfinished_requests(self) -> int:
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return self._core.get_request_counts()[0]
        return self._core.get_num_unfinished_requests()

    def has_finished_requests(self) -> bool:
        # Also under PAUSED_ALL, as in vLLM: the engine then runs a step that schedules nothing
        # and carries the finished ids to the workers.
        return bool(self._error_outputs) or self._num_finished_unreported > 0

    def get_request_counts(self) -> tuple[int, int]:
        return self._core.get_request_counts()

    # ------------------------------------------------------------------ the step

    def schedule(self, throttle_prefills: bool = False) -> Any:
        # throttle_prefills: vLLM's DP engine core holds prefills back between cadence-aligned
        # steps; the core also applies the local cadence (core_config.local_prefill_interval).
        # The core follows the pause state: PAUSED_NEW admits nobody, PAUSED_ALL schedules
        # nothing (the step still reports finished and preempted ids).
        structured = self._structured
        out = None
        if structured.held:
            structured.release_ready()
            core_out = self._core.schedule(throttle_prefills)
            structured.note_passed_over()
        else:
            # One call: the step and, when nobody is admitted, preempted or reported finished
            # (a steady decode), its SchedulerOutput, which needs no bookkeeping here. Requests
            # preempted between steps (reset_prefix_cache) are reported by the step, so that
            # step takes the bookkeeping path.
            core_out, out = self._out.bridge.schedule(throttle_prefills, self.num_spec_tokens)
        self._num_finished_unreported = 0  # the step reports every id finished so far
        if out is None:
            out = self._scheduler_output(core_out)
        elif self._kv_events is not None:
            self._kv_events.collect()
        if structured.live:
            structured.mark_step(out, core_out, self.async_scheduling)
        self._in_flight.append((out, core_out))
        return out

    def _scheduler_output(self, core_out: Any) -> Any:
        """vLLM's ``SchedulerOutput`` for a step that admits, preempts or reports finished
        requests: their bookkeeping first."""
        now = time.monotonic()
        for rid in core_out.finished_req_ids:
            request = self._book.finished(rid, RequestStatus.FINISHED_ERROR)
            if request is not None:
                # Still live here, so it ended inside schedule(): the pool can never hold it
                # (ARCHITECTURE.md). vLLM would preempt it forever; we end it with an error.
                if self._finished_dict is not None:
                    self._finished_dict.setdefault(request.client_index, set()).add(rid)
                message = "dflash-rs: the KV-cache pool can never hold this request"
                output = self._out.error_output(request, message, code="internal_error")
                self._error_outputs.append((request.client_index, output))
        if self._kv_events is not None:
            self._kv_events.collect()
        return self._out.scheduler_output(core_out, now)

    def get_grammar_bitmask(self, scheduler_output: Any) -> Any:
        """vLLM's ``GrammarOutput`` for the structured requests that sample in the step (their
        bitmask rows from vLLM's ``StructuredOutputManager``), or None."""
        structured = self._structured
        if not structured.rows:
            return None  # no step in flight has structured requests
        return structured.grammar_bitmask(scheduler_output)

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        in_flight = self._in_flight
        if not in_flight or in_flight[0][0] is not scheduler_output:
            raise SchedulerStateError(
                "update_from_output got a SchedulerOutput that is not the oldest one "
                "schedule() returned and that awaits its output"
            )
        core_out = in_flight[0][1]  # leaves the queue once its output is applied
        invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None)
        updated: Optional[list[str]] = None
        if core_out is not None and len(core_out):
            # Raises, with nothing applied, on a bad runner output: the step still awaits it.
            by_client, updated = self._out.engine_outputs(
                core_out, model_runner_output, self._finished_dict, want_ids=bool(invalid)
            )
            self._num_finished_unreported += self._out.num_finished
        else:
            by_client = {}
        in_flight.popleft()
        structured = self._structured
        if structured.rows:
            structured.step_done(scheduler_output)
        if structured.compile_errors:
            self._fail_grammars(by_client)
        if self._kv_events is not None:
            self._kv_events.publish(self.kv_event_publisher)
        if self._error_outputs:
            for client, eco in self._error_outputs:
                by_client.setdefault(client, []).append(eco)
            self._error_outputs = []
        EngineCoreOutputs = self._out.EngineCoreOutputs
        outputs: dict[int, Any] = {}
        for client, outs in by_client.items():
            outputs[client] = EngineCoreOutputs(outputs=outs)
        if self._finished_dict:
            for client, ids in self._finished_dict.items():
                eco = outputs.get(client)
                if eco is None:
                    outputs[client] = eco = EngineCoreOutputs()
                eco.finished_requests = ids
            self._finished_dict = {}
        if self.log_stats:
            stats = self._make_stats(
                core_out, _invalid_drafts(scheduler_output, updated) if invalid else []
            )
            eco = next(iter(outputs.values()), None)
            if eco is None:
                outputs[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return outputs

    def _fail_grammars(self, by_client: dict[int, list[Any]]) -> None:
        """Ends the requests whose grammar failed to compile, with vLLM's error output."""
        errors = self._structured.compile_errors
        self._structured.compile_errors = {}
        for request in self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
            message = errors[request.request_id]
            output = self._out.error_output(request, message, code="validation_error")
            by_client.setdefault(request.client_index, []).append(output)

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        if self._structured.live:
            self._structured.validate_drafts(draft_token_ids)  # grammar-valid prefixes
        self._out.bridge.update_draft_token_ids(draft_token_ids)

    def update_draft_token_ids_in_output(self, draft_token_ids: Any, scheduler_output: Any) -> None:
        """Async scheduling: replaces the placeholder drafts of an already built output with
        the runner's, cut to the scheduled count and, for structured requests, to their
        grammar-valid prefix; missing ones are padded with -1 and counted in
        ``num_invalid_spec_tokens`` (left out of the spec-decoding stats), as vLLM does."""
        invalid: dict[str, int] = {}
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        structured = self._structured.live
        requests = self._book.requests
        for rid, drafts in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            placeholders = scheduled.get(rid)
            if not placeholders or rid not in requests:
                continue
            n = len(placeholders)
            del drafts[n:]  # in place, like vLLM
            if structured and rid in structured:
                drafts = self.structured_output_manager.validate_tokens(requests[rid], drafts)
            if len(drafts) < n:
                invalid[rid] = n - len(drafts)
                drafts.extend([-1] * (n - len(drafts)))
            scheduled[rid] = drafts
        scheduler_output.num_invalid_spec_tokens = invalid

    # ------------------------------------------------------------------ state and stats

    @property
    def pause_state(self) -> PauseState:
        return self._pause_state

    def set_pause_state(self, pause_state: PauseState) -> None:
        logger.info("setting pause state to %s", pause_state.name)
        self._core.set_pause_state(_CORE_PAUSE[pause_state])
        self._pause_state = pause_state

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """As vLLM 0.33: with ``reset_running_requests`` every running request is preempted
        first (last first, so they resume in their running order) and the output of their steps
        in flight is dropped when it arrives; the reset then cannot fail. There is no connector
        to reset (``reset_connector`` succeeds trivially, as in vLLM without one)."""
        if reset_running_requests:
            timestamp = time.monotonic()
            preempted = self._core.preempt_all_running(drop_stale_outputs=True)
            for rid in preempted:
                self._book.preempted(rid, timestamp)
            # Reported in the next SchedulerOutput.preempted_req_ids, already booked here.
            self._out.preempted_between_steps.update(preempted)
            # They are preempted and resumed between two steps: the V1 runner must get their
            # tokens again (vLLM clears prev_step_scheduled_req_ids).
            self._out.bridge.forget_previous_step()
        ok = self._core.reset_prefix_cache()
        if self._kv_events is not None:
            self._kv_events.collect()
        if reset_running_requests and not ok:
            raise RuntimeError(
                "dflash-rs: failed to reset the prefix cache with every running request preempted"
            )
        self._prefix_reset |= ok and self.log_stats
        return ok

    def reset_encoder_cache(self) -> None:
        """No encoder cache: multimodal models are refused."""

    def get_kv_cache_usage(self) -> float:
        return self._core.kv_cache_usage

    def make_stats(self) -> Optional[SchedulerStats]:
        return self._make_stats(None, []) if self.log_stats else None

    def _make_stats(self, core_out: Any, invalid: list[tuple[int, int]]) -> SchedulerStats:
        """vLLM's ``SchedulerStats`` since the previous stats, built in Rust from the core's
        counters (``_VllmBridge.scheduler_stats``); with ``core_out`` (the step just applied)
        it carries the step's ``SpecDecodingStats``. ``invalid`` holds (scheduled, invalid)
        draft counts of verified requests whose drafts were padded (left out, as vLLM does)."""
        stats = self._out.bridge.scheduler_stats(
            with_spec=core_out is not None and self.num_spec_tokens > 0,
            invalid=invalid,
            prefix_reset=self._prefix_reset,
        )
        self._prefix_reset = False
        return stats

    def shutdown(self) -> None:
        """Stops vLLM's event publisher; the Rust core frees its memory with the object."""
        self.kv_event_publisher.shutdown()

    def get_kv_connector(self) -> None:
        return None

    def get_ec_connector(self) -> None:
        return None

    def get_kv_event_publisher_config(self) -> Any:
        return self.kv_event_publisher.get_publisher_config()

    # ------------------------------------------------------------------ dflash-rs extras

    @property
    def core(self) -> CoreScheduler:
        """The underlying ``dflash_rs.Scheduler`` (read its state, ``check_invariants()``)."""
        return self._core


def _kv_events_reason(request: Any) -> Optional[str]:
    """Why a request cannot be served with KV-cache events on, or None."""
    if getattr(request, "kv_cache_report_mode", "incremental") != "incremental":
        # vLLM re-reports prefix hits at each lookup, which the core does not mirror.
        return "kv_cache_report_mode 'full' (BlockStored for prefix hits) is not supported"
    return None


def _invalid_drafts(scheduler_output: Any, updated: Optional[list[str]]) -> list[tuple[int, int]]:
    """(scheduled, invalid) draft counts of the requests verified in this output (``updated``)
    whose drafts ``update_draft_token_ids_in_output`` padded (vLLM leaves those out of its
    stats)."""
    invalid = getattr(scheduler_output, "num_invalid_spec_tokens", None)
    if not invalid or not updated:
        return []
    spec = scheduler_output.scheduled_spec_decode_tokens
    return [(len(spec[rid]), invalid[rid]) for rid in updated if rid in invalid and rid in spec]
