"""dflash-rs step outputs -> vLLM's ``SchedulerOutput`` and ``EngineCoreOutputs``.

Only Python objects vLLM's types require are built here; the per-request dicts and lists come
ready-made from the Rust core (``num_scheduled_tokens``, ``scheduled_spec_decode_tokens``,
``scheduled_cached_reqs``, the finished and preempted id sets).
"""

from __future__ import annotations

from typing import Any, Optional

from dflash_rs.vllm._compat import installed
from dflash_rs.vllm._requests import RequestBook

__all__ = ["OutputBuilder"]


class OutputBuilder:
    """Builds vLLM's output types; holds the vLLM classes it needs (imported once)."""

    def __init__(
        self,
        book: RequestBook,
        num_spec_tokens: int,
        use_v2_model_runner: bool,
        async_scheduling: bool = False,
    ) -> None:
        from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
        from vllm.v1.request import RequestStatus

        self.book = book
        self.num_spec_tokens = num_spec_tokens
        self.v2 = use_v2_model_runner
        #: Steps overlap: scheduled drafts are mostly placeholders, and running requests count
        #: the outputs still in flight (``num_output_placeholders``).
        self.async_scheduling = async_scheduling
        self.NewRequestData = NewRequestData
        self.CachedRequestData = CachedRequestData
        self.SchedulerOutput = SchedulerOutput
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
        #: Ids scheduled in the previous step (V1 model runner: `all_token_ids` goes to the
        #: requests that were not).
        self.prev_scheduled: Any = set()
        #: Requests preempted between steps (reset_prefix_cache), already marked preempted;
        #: the next step reports them.
        self.preempted_between_steps: set[str] = set()
        #: Requests that finished in the last engine_outputs call.
        self.num_finished = 0

    def scheduler_output(self, core: Any, out: Any, now: float) -> Any:
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
            data = self.NewRequestData(
                req_id=rid,
                prompt_token_ids=req.prompt_token_ids,
                mm_features=[],
                sampling_params=req.sampling_params,
                pooling_params=None,
                block_ids=(nd.block_ids,),
                num_computed_tokens=nd.num_computed_tokens,
                lora_request=None,
                prefill_token_ids=nd.all_token_ids if self.v2 else None,
            )
            (resumed_reqs if resumed else new_reqs).append(data)
        new_reqs.extend(resumed_reqs)  # vLLM lists new requests first, then resumed ones
        cached = self._cached(core, out)
        num_scheduled_tokens = out.num_scheduled_tokens  # a new dict at every access
        if not self.v2:
            self.prev_scheduled = num_scheduled_tokens.keys()
        return self.SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=out.total_num_scheduled_tokens,
            scheduled_spec_decode_tokens=self._spec_tokens(out),
            scheduled_encoder_inputs={},
            finished_req_ids=out.finished_req_ids,
            free_encoder_mm_hashes=[],
            preempted_req_ids=out.preempted_req_ids,
            num_spec_tokens_to_schedule=self.num_spec_tokens,
        )

    def _spec_tokens(self, out: Any) -> dict[str, list[int]]:
        """``scheduled_spec_decode_tokens``. The drafts the core scheduled are (a prefix of) the
        lists the runner handed to ``update_draft_token_ids``; reusing those list objects, as
        vLLM does, saves building a new int list per request. Admissions never carry the runner's
        drafts (a padded admission has placeholder drafts, ``-1``): those steps use the core's."""
        counts = out.num_spec_tokens_array
        if not counts.any():
            return {}
        if self.async_scheduling:
            # Placeholders (-1) for drafts the runner proposes after this step was planned;
            # drafts handed to update_draft_token_ids may be older than the step.
            return out.scheduled_spec_decode_tokens
        drafts = self.book.drafts
        admitted = {r.req_id for r in out.scheduled_new_reqs}
        spec = {}
        for rid, n in zip(out.req_ids, counts.tolist()):
            if n:
                d = drafts.get(rid)
                if d is None or len(d) < n or rid in admitted:
                    return out.scheduled_spec_decode_tokens  # not from update_draft_token_ids
                spec[rid] = d if len(d) == n else d[:n]
        return spec

    def _cached(self, core: Any, out: Any) -> Any:
        c = out.scheduled_cached_reqs
        req_ids = c.req_ids
        resumed = c.resumed_req_ids
        new_block_ids = [None if b is None else (b,) for b in c.new_block_ids]
        num_computed = c.num_computed_tokens
        all_token_ids: dict[str, list[int]] = {}
        if resumed and self.v2:
            # V2: resumed requests travel in scheduled_new_reqs only.
            keep = [i for i, rid in enumerate(req_ids) if rid not in resumed]
            req_ids = [req_ids[i] for i in keep]
            new_block_ids = [new_block_ids[i] for i in keep]
            num_computed = [num_computed[i] for i in keep]
            resumed = set()
        elif not self.v2:
            prev = self.prev_scheduled
            for rid in req_ids:
                if rid not in prev:
                    all_token_ids[rid] = core.all_token_ids(rid)
        num_output = self.book.num_output
        if self.async_scheduling:
            # vLLM counts the outputs of the steps in flight too.
            ph = dict(zip(out.req_ids, out.num_output_placeholders.tolist()))
            num_output_tokens = [num_output[rid] + ph[rid] for rid in req_ids]
        else:
            num_output_tokens = [num_output[rid] for rid in req_ids]
        return self.CachedRequestData(
            req_ids=req_ids,
            resumed_req_ids=resumed,
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids,
            num_computed_tokens=num_computed,
            num_output_tokens=num_output_tokens,
        )

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
        results: Any,
        runner_output: Any,
        finished_dict: Optional[dict[int, set[str]]],
    ) -> dict[int, list[Any]]:
        """Per client index, one ``EngineCoreOutput`` per request that got tokens; finished
        requests are marked and forgotten."""
        self.num_finished = 0
        book = self.book
        num_output = book.num_output
        slow = book.slow_path
        make = self.EngineCoreOutput
        nans = runner_output.num_nans_in_logits
        single_client = book.num_other_clients == 0
        client0: list[Any] = []
        by_client: dict[int, list[Any]] = {0: client0} if single_client else {}
        finished = results.finished
        for rid, tokens in zip(results.req_ids, results.new_token_ids):
            num_output[rid] += len(tokens)
            finish = finished.get(rid) if finished else None
            if single_client and finish is None and rid not in slow and not nans:
                client0.append(make(rid, tokens))  # the steady-state decode output
                continue
            client = 0 if single_client else book.requests[rid].client_index
            eco = self._engine_output(finish, rid, tokens, runner_output, finished_dict)
            if single_client:
                client0.append(eco)
            else:
                by_client.setdefault(client, []).append(eco)
        if single_client and not client0:
            del by_client[0]
        return by_client

    def _engine_output(
        self,
        finish: Optional[tuple[str, Optional[int]]],
        rid: str,
        tokens: list[int],
        runner_output: Any,
        finished_dict: Optional[dict[int, set[str]]],
    ) -> Any:
        """The output of a request that needs more than its tokens: first output (prefill
        stats), events, logprobs, NaN counts, or the final one."""
        book = self.book
        request = book.requests[rid]
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
