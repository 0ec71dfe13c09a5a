"""dflash-rs step outputs -> vLLM's ``SchedulerOutput`` and ``EngineCoreOutputs``.

The per-request parts are built in Rust, in one pass (``dflash_rs._core._VllmBridge``): the
``CachedRequestData`` lists, ``num_scheduled_tokens``, ``scheduled_spec_decode_tokens``, and one
``EngineCoreOutput`` per request that only got tokens. Python builds what needs vLLM's
``Request`` objects: ``NewRequestData`` of admissions, and the outputs that carry events,
prefill stats, logprobs, prompt logprobs or a finish.
"""

from __future__ import annotations

from typing import Any, Optional

from dflash_rs._core import _VllmBridge
from dflash_rs.vllm._compat import installed
from dflash_rs.vllm._requests import RequestBook

__all__ = ["OutputBuilder"]


class OutputBuilder:
    """Builds vLLM's output types; holds the vLLM classes it needs (imported once)."""

    def __init__(
        self,
        core: Any,
        book: RequestBook,
        num_spec_tokens: int,
        use_v2_model_runner: bool,
        async_scheduling: bool = False,
    ) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
        from vllm.v1.request import RequestStatus
        from vllm.v1.spec_decode.metrics import SpecDecodingStats

        self.book = book
        self.num_spec_tokens = num_spec_tokens
        self.v2 = use_v2_model_runner
        self.NewRequestData = NewRequestData
        self.EngineCoreOutput = EngineCoreOutput
        self.EngineCoreOutputs = EngineCoreOutputs
        self.FinishReason = FinishReason
        #: dflash-rs finish reason -> (vLLM RequestStatus, vLLM FinishReason).
        self.finish_map = {
            "stop": (RequestStatus.FINISHED_STOPPED, FinishReason.STOP),
            "length": (RequestStatus.FINISHED_LENGTH_CAPPED, FinishReason.LENGTH),
            "abort": (RequestStatus.FINISHED_ABORTED, FinishReason.ABORT),
            "error": (RequestStatus.FINISHED_ERROR, FinishReason.ERROR),
        }
        #: Builds the per-request parts in Rust (vLLM's classes resolved once, here).
        self.bridge = _VllmBridge(
            core,
            SchedulerOutput,
            CachedRequestData,
            EngineCoreOutput,
            FinishReason,
            stats=(SchedulerStats, PrefixCacheStats, SpecDecodingStats),
            v2=use_v2_model_runner,
            async_scheduling=async_scheduling,
        )
        #: Requests preempted between steps (reset_prefix_cache), already marked preempted;
        #: the next step reports them.
        self.preempted_between_steps: set[str] = set()
        #: Requests that finished in the last engine_outputs call.
        self.num_finished = 0
        self.core = core
        #: The scheduler's structured-output requests (``_structured.StructuredOutputs``).
        self.structured: Any = None

    def scheduler_output(self, out: Any, now: float) -> Any:
        """vLLM's ``SchedulerOutput`` for the dflash-rs step ``out``; updates the bookkeeping
        of admitted and preempted requests."""
        book = self.book
        requests = book.requests
        early = self.preempted_between_steps
        for rid in out.preempted_req_ids:
            if rid not in early:
                book.preempted(rid, now)
        early.clear()
        new_reqs: list[Any] = []
        resumed_reqs: list[Any] = []
        for nd in out.scheduled_new_reqs:
            rid = nd.req_id
            resumed = nd.resumed
            book.admitted(rid, nd.num_computed_tokens, resumed, now)
            if resumed and not self.v2:
                continue  # V1: a resumed request is a cached one with all its blocks
            req = requests[rid]
            if self.v2:
                # vLLM hands over the request's own token list; a new request's holds its
                # prompt (the adapter never appends outputs to it), a resumed one's would not.
                prefill = nd.all_token_ids if resumed else req._all_token_ids
            else:
                prefill = None
            data = self.NewRequestData(
                req_id=rid,
                prompt_token_ids=req.prompt_token_ids,
                mm_features=[],
                sampling_params=req.sampling_params,
                pooling_params=None,
                block_ids=(nd.block_ids,),
                num_computed_tokens=nd.num_computed_tokens,
                lora_request=req.lora_request,
                prompt_embeds=req.prompt_embeds,
                prompt_is_token_ids=req.prompt_is_token_ids,
                prefill_token_ids=prefill,
            )
            (resumed_reqs if resumed else new_reqs).append(data)
        new_reqs.extend(resumed_reqs)  # vLLM lists new requests first, then resumed ones
        return self.bridge.scheduler_output(out, new_reqs, self.num_spec_tokens)

    def error_output(self, request: Any, message: str, code: str = "validation_error") -> Any:
        """The final output of a request dflash-rs refused or could not serve."""
        kwargs: dict[str, Any] = {}
        if installed().output_has_error:
            from vllm.outputs import RequestError

            kwargs["error"] = RequestError(code=code, message=message, retryable=False)
        return self.EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=self.FinishReason.ERROR,
            events=request.take_events(),
            trace_headers=request.trace_headers,
            **kwargs,
        )

    def engine_outputs(
        self,
        out: Any,
        runner_output: Any,
        finished_dict: Optional[dict[int, set[str]]],
        want_ids: bool = False,
    ) -> tuple[dict[int, list[Any]], Optional[list[str]]]:
        """Applies ``runner_output`` to the step ``out``. Per client index, one
        ``EngineCoreOutput`` per request that got tokens (finished requests are marked and
        forgotten), and with ``want_ids`` the ids of those requests."""
        self.num_finished = 0
        book = self.book
        single_client = book.num_other_clients == 0
        prompt_logprobs = runner_output.prompt_logprobs_dict
        token_id_logprobs = runner_output.prompt_token_id_logprobs_dict
        if prompt_logprobs or token_id_logprobs or book.prompt_logprobs_due:
            # Requests with prompt logprobs to deliver take the slow path for this output.
            book.deliver_prompt_logprobs(prompt_logprobs, token_id_logprobs)
        outputs, slow, finished, ids = self.bridge.engine_outputs(
            out,
            runner_output,
            book.slow_path,
            all_slow=not single_client or bool(runner_output.num_nans_in_logits),
            want_ids=want_ids,
        )
        # Final outputs built in Rust (nothing but the finish to report): bookkeeping only.
        finish_map = self.finish_map
        for rid, reason, stop in finished:
            request = book.finished(rid, finish_map[reason][0], stop)
            if finished_dict is not None and request is not None:
                finished_dict.setdefault(request.client_index, set()).add(rid)
        self.num_finished = len(finished)
        if single_client:
            for pos, rid, tokens, reason, stop in slow:
                finish = None if reason is None else (reason, stop)
                outputs[pos] = self._engine_output(
                    finish, rid, tokens, runner_output, finished_dict
                )
            return ({0: outputs} if outputs else {}), ids
        by_client: dict[int, list[Any]] = {}
        for _, rid, tokens, reason, stop in slow:  # every output is slow with several clients
            client = book.requests[rid].client_index
            finish = None if reason is None else (reason, stop)
            eco = self._engine_output(finish, rid, tokens, runner_output, finished_dict)
            by_client.setdefault(client, []).append(eco)
        return by_client, ids

    def _engine_output(
        self,
        finish: Optional[tuple[str, Optional[int]]],
        rid: str,
        tokens: list[int],
        runner_output: Any,
        finished_dict: Optional[dict[int, set[str]]],
    ) -> Any:
        """The output of a request that needs more than its tokens: first output (prefill
        stats), events, logprobs, prompt logprobs, NaN counts, or the final one."""
        book = self.book
        request = book.requests[rid]
        structured = self.structured
        if structured is not None and rid in structured.live and tokens:
            if not structured.accept(request, tokens):
                # vLLM ends a request whose grammar rejects its tokens, with an error.
                if finish is None:
                    self.core.finish_requests([rid], "error")
                finish = ("error", None if finish is None else finish[1])
        kwargs: dict[str, Any] = {}
        events = book.take_events(rid, request)
        if events is not None:
            kwargs["events"] = events
        stats = book.take_prefill_stats(rid, request)
        if stats is not None:
            kwargs["prefill_stats"] = stats
        logprobs = runner_output.logprobs
        if logprobs is not None and request.sampling_params.num_logprobs is not None:
            index = runner_output.req_id_to_index[rid]
            kwargs["new_logprobs"] = logprobs.slice_request(index, len(tokens))
        if rid in book.prompt_logprobs_due:
            book.prompt_logprobs_due.discard(rid)
            prompt = runner_output.prompt_logprobs_dict.get(rid)
            if prompt is not None:
                kwargs["new_prompt_logprobs_tensors"] = prompt
            token_ids = runner_output.prompt_token_id_logprobs_dict.get(rid)
            if token_ids is not None:
                kwargs["prompt_token_id_logprobs"] = token_ids
        nans = runner_output.num_nans_in_logits
        if nans and rid in nans:
            request.num_nans_in_logits = nans[rid]
            kwargs["num_nans_in_logits"] = nans[rid]
        if request.trace_headers is not None:
            kwargs["trace_headers"] = request.trace_headers
        book.refresh_slow_path(rid)
        if finish is not None:
            reason, stop_reason = finish
            self.num_finished += 1
            status, vllm_reason = self.finish_map[reason]
            kwargs["finish_reason"] = vllm_reason
            kwargs["stop_reason"] = stop_reason
            book.finished(rid, status, stop_reason)
            if finished_dict is not None:
                finished_dict.setdefault(request.client_index, set()).add(rid)
        return self.EngineCoreOutput(request_id=rid, new_token_ids=tokens, **kwargs)
