"""Structured outputs (JSON schema, regex, choice, grammar) through vLLM's own
``StructuredOutputManager``: the scheduler's part, as vLLM's ``Scheduler`` does it.

The engine compiles each request's grammar (``grammar_init``, asynchronously) before handing it
over; its status is then ``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``. Here:

- such a request is held back from admission in the core (``set_admission_hold``) and released
  once its grammar is ready, so admission passes it over exactly where vLLM skips it; a grammar
  that failed to compile ends the request with vLLM's error output, in the
  ``update_from_output`` after the ``schedule()`` whose admission loop reached it, as vLLM;
- each step records which structured requests sample (not prefill chunks), in the order of
  ``num_scheduled_tokens``: ``get_grammar_bitmask`` asks the manager for their rows;
- draft tokens are cut to their grammar-valid prefix (``validate_tokens``) in both draft paths;
- the tokens each request receives advance its grammar (``accept_tokens``); a rejection ends it
  with finish reason ``error``, as vLLM.

Requests without structured output never reach this module in the per-step paths: every hook
returns at once while no structured request is live.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

__all__ = ["StructuredOutputs", "structured_reason"]

logger = logging.getLogger(__name__)


def structured_reason(manager: Any, request: Any) -> Optional[str]:
    """Why the drop-in cannot serve this structured-output request, or None."""
    if manager is None:
        return "structured outputs need the engine's StructuredOutputManager"
    if manager.reasoner_cls is not None and not manager.enable_in_reasoning:
        # The manager would read the request's token history (kept in the Rust core) to find
        # where reasoning ends.
        return (
            "structured outputs with a reasoning parser are supported only with "
            "structured_outputs_config.enable_in_reasoning=True"
        )
    return None


class StructuredOutputs:
    """The live structured-output requests and what each step needs of them."""

    def __init__(self, manager: Any, core: Any, requests: dict[str, Any]) -> None:
        from vllm.v1.core.sched.output import GrammarOutput
        from vllm.v1.request import RequestStatus
        from vllm.v1.structured_output.utils import strip_speculative_padding

        self.manager = manager
        self.core = core
        #: The scheduler's live vLLM requests (the manager reads their grammars there).
        self.requests = requests
        self.GrammarOutput = GrammarOutput
        self.strip_padding = strip_speculative_padding
        self.Status = RequestStatus
        #: Live requests with structured output.
        self.live: set[str] = set()
        #: Those whose grammar is still compiling (held back from admission in the core).
        self.held: dict[str, Any] = {}
        #: Requests whose grammar failed to compile, found by a schedule(): id -> message;
        #: the next update_from_output ends them.
        self.compile_errors: dict[str, str] = {}
        #: Per SchedulerOutput in flight (by id): its sampling structured requests, in the
        #: order of num_scheduled_tokens (the order of the bitmask's rows).
        self.rows: dict[int, list[str]] = {}

    # ------------------------------------------------------------------ requests

    def add(self, request: Any) -> None:
        """A structured-output request entered the core: hold it while its grammar compiles."""
        rid = request.request_id
        self.live.add(rid)
        if request.status == self.Status.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            self.core.set_admission_hold(rid, True)
            self.held[rid] = request

    def forget(self, rid: str) -> None:
        """A request finished."""
        self.live.discard(rid)
        self.held.pop(rid, None)
        self.compile_errors.pop(rid, None)

    # ------------------------------------------------------------------ the step

    def release_ready(self) -> None:
        """Before ``schedule()``: releases the held requests whose grammar is ready (vLLM
        promotes them to WAITING when admission reaches them; a grammar that is ready then was
        ready before the step). Failed ones stay held: see ``note_passed_over``."""
        for rid, request in list(self.held.items()):
            grammar = request.structured_output_request.grammar
            if grammar is None or isinstance(grammar, Exception):
                continue
            request.status = self.Status.WAITING
            self.core.set_admission_hold(rid, False)
            del self.held[rid]

    def note_passed_over(self) -> None:
        """After ``schedule()``: a held request its admission loop reached whose grammar failed
        is ended by the next ``update_from_output`` (vLLM's ``grammar_compile_error_reqs``)."""
        for rid in self.core.held_passed_over():
            request = self.held.get(rid)
            if request is None:
                continue
            grammar = request.structured_output_request.grammar
            if isinstance(grammar, Exception):
                self.compile_errors[rid] = f"Invalid structured outputs: {grammar}"

    def mark_step(self, scheduler_output: Any, core_out: Any, async_scheduling: bool) -> None:
        """Sets ``has_structured_output_requests`` (and, with async scheduling,
        ``pending_structured_output_tokens``: a sampling structured request still awaits the
        tokens of an earlier step) and records the step's bitmask rows."""
        live = self.live
        rows = [rid for rid in scheduler_output.num_scheduled_tokens if rid in live]
        if not rows:
            return
        index = {rid: i for i, rid in enumerate(core_out.req_ids)}
        prefill_chunk = core_out.is_prefill_chunk
        placeholders = core_out.num_output_placeholders
        sampling = [rid for rid in rows if not prefill_chunk[index[rid]]]
        if not sampling:
            return
        scheduler_output.has_structured_output_requests = True
        if async_scheduling:
            scheduler_output.pending_structured_output_tokens = any(
                placeholders[index[rid]] > 0 for rid in sampling
            )
        self.rows[id(scheduler_output)] = sampling

    def step_done(self, scheduler_output: Any) -> None:
        """The step's output was applied: its rows are no longer needed."""
        self.rows.pop(id(scheduler_output), None)

    def grammar_bitmask(self, scheduler_output: Any) -> Any:
        """vLLM's ``GrammarOutput`` for the step (None if no structured request samples)."""
        if not scheduler_output.has_structured_output_requests:
            return None
        requests = self.requests
        ids = [rid for rid in self.rows.get(id(scheduler_output), ()) if rid in requests]
        if not ids:
            return None
        spec = scheduler_output.scheduled_spec_decode_tokens
        bitmask = self.manager.grammar_bitmask(requests, ids, spec)
        acceptable = [len(self.strip_padding(spec.get(rid, []))) for rid in ids]
        return self.GrammarOutput(ids, bitmask, acceptable)

    # ------------------------------------------------------------------ tokens

    def accept(self, request: Any, tokens: list[int]) -> bool:
        """Advances the request's grammar by the tokens it received; False if it rejects
        them (vLLM then ends the request with an error)."""
        if not tokens or self.manager.accept_tokens(request, tokens):
            return True
        logger.error(
            "Unexpected: grammar rejected tokens %s for request %s. Terminating request.",
            tokens,
            request.request_id,
        )
        return False

    def validate_drafts(self, draft_token_ids: Any) -> None:
        """``update_draft_token_ids``: replaces the drafts of structured requests by their
        grammar-valid prefix, in place (a prefill chunk's drafts are dropped by the core)."""
        requests = self.requests
        lists = draft_token_ids.draft_token_ids
        for i, rid in enumerate(draft_token_ids.req_ids):
            if rid in self.live and rid in requests:
                lists[i] = self.manager.validate_tokens(requests[rid], lists[i])
