"""Lockstep driver for structured outputs: vLLM's ``Scheduler`` (or ``AsyncScheduler``) and
``DFlashRsScheduler``, each with its own ``StructuredOutputManager``, on one seeded trace of
JSON-schema, regex and choice requests mixed with plain ones.

Both get equal (but separate) vLLM ``Request`` objects, validated as the engine's input
processor validates them (``SamplingParams._validate_structured_outputs``: it picks the backend
and may rewrite the constraint), whose grammars their own manager compiles (``grammar_init``,
as the engine does) on a gated executor: each compilation completes
at a seeded step, so requests wait for their grammar (``WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR``)
at the same steps on both sides; one grammar may fail to compile. The fabricated runner samples
what a real one may: a structured request's tokens lie in its bitmask rows (the drafts it
accepts are allowed by theirs, up to ``num_acceptable_drafts``), drafts are walked through the
grammar (sometimes with an invalid token, which ``validate_tokens`` must cut). Engine loops as
vLLM's: ``step`` then ``update_draft_token_ids`` in sync mode; with async scheduling
``step_with_batch_queue`` with two batches, deferring a step's sampling while
``pending_structured_output_tokens`` (its drafts then come through
``update_draft_token_ids_in_output``).

After every call the two are compared: SchedulerOutputs (``parity.compare_outputs`` plus the
structured-output flags), the ``GrammarOutput`` (ids, rows, acceptable drafts), the engine
outputs (tokens, finish reasons, errors), the request counts.
"""

from __future__ import annotations

import copy
import re
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
from parity import (
    Divergence,
    _norm_engine,
    compare_outputs,
    draft_token_ids,
    model_runner_env,
    runner_output,
    scheduled_drafts,
    use_v1_runner,
)

EOS = 2
FIRST_TOKEN = 3  # the byte tokens of the offline tokenizer start after <unk>, <s>, </s>

#: (kind, constraint) pairs the trace draws from; tight enough that random sampling inside the
#: grammar ends (EOS) within a few dozen tokens.
CONSTRAINTS: list[tuple[str, Any]] = [
    (
        "json",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": ["ab", "cde"]},
                "ok": {"type": "boolean"},
            },
            "required": ["name", "ok"],
            "additionalProperties": False,
        },
    ),
    ("regex", "[a-c]{2,5}x[0-9]"),
    ("choice", ["yes", "no", "maybe"]),
]
#: A regex no backend compiles.
BAD_REGEX = "(unclosed"
#: vLLM's xgrammar backend passes an argument this xgrammar deprecates (a warning per grammar,
#: which pytest would turn into a compile error).
XGRAMMAR_WARNING = "ignore:max_rollback_tokens is deprecated:DeprecationWarning"


@dataclass
class StructuredParams:
    """One seeded trace; a small pool and budget so that chunked prefill and preemption happen."""

    seed: int
    backend: str = "xgrammar"
    method: str = "none"
    k: int = 3
    async_scheduling: bool = False
    num_blocks: int = 40
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 6
    max_num_batched_tokens: int = 96
    num_requests: int = 14
    plain_prob: float = 0.3
    abort_prob: float = 0.01
    arrival_prob: float = 0.4
    #: Steps a grammar may take to compile (drawn per request from 0..max_compile_steps).
    max_compile_steps: int = 3
    #: One request whose grammar fails to compile.
    bad_grammar: bool = True
    max_steps: int = 500
    v1_runner: bool = False


@dataclass
class StructuredResult:
    steps: int = 0
    bitmasks: int = 0
    held_steps: int = 0
    invalid_drafts: int = 0
    preemptions: int = 0
    aborted: int = 0
    errors: dict[str, str] = field(default_factory=dict)
    #: Per structured request: (kind, constraint, output tokens, finish reason name).
    outputs: dict[str, tuple[str, Any, list[int], Optional[str]]] = field(default_factory=dict)


class GatedExecutor:
    """Stands in for the manager's compile executor: a submitted compilation runs when the
    trace releases it, so both sides see a grammar become ready at the same step."""

    def __init__(self) -> None:
        self.pending: dict[str, tuple[Future, Callable[..., Any], tuple[Any, ...]]] = {}

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.pending[args[0].request_id] = (future, fn, args)
        return future

    def release(self, rid: str) -> None:
        future, fn, args = self.pending.pop(rid)
        try:
            future.set_result(fn(*args))
        except Exception as e:  # the compile error travels in the future, as in vLLM
            future.set_exception(e)

    def shutdown(self, **_: Any) -> None:
        pass


def _fail(p: StructuredParams, step: int, what: str, ours: Any, vllm: Any) -> Divergence:
    return Divergence(
        f"seed={p.seed} backend={p.backend} method={p.method} async={p.async_scheduling} "
        f"step={step}: {what}\n  vLLM:     {vllm!r}\n  dflash-rs: {ours!r}"
    )


def allowed_tokens(row: np.ndarray) -> np.ndarray:
    """Token ids a bitmask row allows."""
    bits = np.unpackbits(np.ascontiguousarray(row).view(np.uint8), bitorder="little")
    return np.nonzero(bits)[0]


class StructuredLockstep:
    def __init__(self, offline: Any, p: StructuredParams) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        from dflash_rs.vllm import DFlashRsScheduler
        from dflash_rs.vllm._compat import installed

        self.p = p
        self.offline = offline
        self.packed_rows = installed().name == "0.32"  # 0.32 packs rows, 0.33 strides K + 1
        with model_runner_env(use_v1_runner(p.v1_runner)):
            from vllm.config import StructuredOutputsConfig

            cfg, kv = offline.configs(
                vllm={"structured_outputs_config": StructuredOutputsConfig(backend=p.backend)},
                num_blocks=p.num_blocks,
                method=p.method,
                num_speculative_tokens=p.k,
                block_size=p.block_size,
                max_model_len=p.max_model_len,
                max_num_seqs=p.max_num_seqs,
                max_num_batched_tokens=p.max_num_batched_tokens,
                async_scheduling=p.async_scheduling,
                tokenizer=True,
            )
            self.cfg = cfg
            cls = AsyncScheduler if p.async_scheduling else Scheduler
            self.vllm = offline.scheduler(cls, cfg, kv)
            self.ours = offline.scheduler(DFlashRsScheduler, cfg, kv)
        self.k = self.vllm.num_spec_tokens
        self.gates = (GatedExecutor(), GatedExecutor())
        self.vllm.structured_output_manager.executor = self.gates[0]
        self.ours.structured_output_manager.executor = self.gates[1]
        self.hasher = offline.block_hasher(cfg)
        self.tokenizer = self.vllm.structured_output_manager.tokenizer
        self.vocab = len(self.tokenizer)
        self.rng = np.random.default_rng(p.seed)
        self.res = StructuredResult()
        self.next_id = 0
        #: Compilations still gated: request id -> step at which they complete.
        self.compile_at: dict[str, int] = {}
        self.kinds: dict[str, tuple[str, Any]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.bad_id: Optional[str] = None

    # ------------------------------------------------------------------ requests

    def _new_request(self, step: int) -> None:
        from vllm.sampling_params import StructuredOutputsParams

        p, rng = self.p, self.rng
        rid = f"r{self.next_id}"
        self.next_id += 1
        n = int(rng.integers(8, p.max_model_len // 3))
        prompt = rng.integers(FIRST_TOKEN, self.vocab, n).tolist()
        max_tokens = int(rng.integers(8, 48))
        so = None
        if self.bad_id is None and p.bad_grammar and self.next_id == 3:
            kind, constraint = "regex", BAD_REGEX
            self.bad_id = rid
        elif rng.random() >= p.plain_prob:
            kind, constraint = CONSTRAINTS[int(rng.integers(0, len(CONSTRAINTS)))]
        else:
            kind, constraint = "plain", None
        if kind != "plain":
            so = {kind: constraint}
        reqs = []
        for _ in range(2):
            kwargs: dict[str, Any] = {"eos_token_id": EOS}
            if so is not None:
                kwargs["structured_outputs"] = StructuredOutputsParams(**copy.deepcopy(so))
            req = self.offline.request(rid, prompt, max_tokens, self.hasher, **kwargs)
            if rid == self.bad_id:
                # Past the input processor's validation, which would refuse it.
                req.sampling_params.structured_outputs._backend = p.backend
            elif so is not None:
                # The engine's input processor: picks the backend, may rewrite the constraint
                # (vLLM 0.32 turns choices into a grammar for xgrammar).
                req.sampling_params._validate_structured_outputs(
                    self.cfg.model_config, self.cfg.structured_outputs_config, self.tokenizer
                )
            reqs.append(req)
        rv, rd = reqs
        if so is not None:
            self.kinds[rid] = (kind, constraint)
            self.tokens[rid] = []
            self.vllm.structured_output_manager.grammar_init(rv)
            self.ours.structured_output_manager.grammar_init(rd)
            self.compile_at[rid] = step + int(rng.integers(0, p.max_compile_steps + 1))
        self.vllm.add_request(rv)
        self.ours.add_request(rd)

    def _compile_due(self, step: int) -> None:
        for rid, at in list(self.compile_at.items()):
            if at <= step:
                del self.compile_at[rid]
                for gate in self.gates:
                    gate.release(rid)

    def _arrivals_and_aborts(self, step: int) -> None:
        from vllm.v1.request import RequestStatus

        p, rng = self.p, self.rng
        if self.next_id < p.num_requests and (self.next_id == 0 or rng.random() < p.arrival_prob):
            self._new_request(step)
        if self.vllm.requests and rng.random() < p.abort_prob:
            live = sorted(self.vllm.requests)
            rid = live[int(rng.integers(0, len(live)))]
            a = self.vllm.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            b = self.ours.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
            if [r.request_id for r in a] != [r.request_id for r in b]:
                raise _fail(p, step, "finish_requests", b, a)
            self.res.aborted += len(a)
        self._compile_due(step)
        self.res.held_steps += sum(
            r.status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
            for r in self.vllm.requests.values()
        )

    # ------------------------------------------------------------------ comparisons

    def _compare_schedule(self, step: int, sv: Any, sd: Any) -> None:
        compare_outputs(self.p, step, sv, sd)  # type: ignore[arg-type]
        for name in ("has_structured_output_requests", "pending_structured_output_tokens"):
            a, b = getattr(sv, name), getattr(sd, name)
            if a != b:
                raise _fail(self.p, step, f"SchedulerOutput.{name}", b, a)
        self.res.preemptions += len(sv.preempted_req_ids or ())

    def _bitmasks(self, step: int, sv: Any, sd: Any) -> Any:
        gv = self.vllm.get_grammar_bitmask(sv)
        gd = self.ours.get_grammar_bitmask(sd)
        if (gv is None) != (gd is None):
            raise _fail(self.p, step, "get_grammar_bitmask", gd, gv)
        if gv is None:
            return None
        # The rows of each request (the runner maps them by id: the order is each side's
        # batch order).
        a = self._rows_by_request(gv, sv.scheduled_spec_decode_tokens)
        b = self._rows_by_request(gd, sd.scheduled_spec_decode_tokens)
        if a.keys() != b.keys():
            raise _fail(self.p, step, "GrammarOutput.structured_output_request_ids", b, a)
        for rid in a:
            if a[rid][0] != b[rid][0]:
                raise _fail(self.p, step, f"num_acceptable_drafts of {rid}", b[rid][0], a[rid][0])
            if not np.array_equal(a[rid][1], b[rid][1]):
                raise _fail(self.p, step, f"bitmask rows of {rid}", "rows differ", "")
        self.res.bitmasks += 1
        return gv

    def _compare_engine(self, step: int, ov: dict[int, Any], od: dict[int, Any]) -> None:
        a, b = _norm_engine(ov), _norm_engine(od)
        if a != b:
            raise _fail(self.p, step, "EngineCoreOutputs", b, a)
        errors_v = {o.request_id: _error(o) for e in ov.values() for o in e.outputs}
        errors_d = {o.request_id: _error(o) for e in od.values() for o in e.outputs}
        if errors_v != errors_d:
            raise _fail(self.p, step, "EngineCoreOutput.error", errors_d, errors_v)
        for e in ov.values():
            for o in e.outputs:
                if o.request_id in self.tokens:
                    self.tokens[o.request_id].extend(o.new_token_ids)
                    if o.finish_reason is not None:
                        kind, constraint = self.kinds[o.request_id]
                        self.res.outputs[o.request_id] = (
                            kind,
                            constraint,
                            self.tokens[o.request_id],
                            o.finish_reason.name.lower(),
                        )
                if errors_v[o.request_id] is not None:
                    self.res.errors[o.request_id] = errors_v[o.request_id][1]
        if self.vllm.get_request_counts() != self.ours.get_request_counts():
            raise _fail(
                self.p,
                step,
                "get_request_counts",
                self.ours.get_request_counts(),
                self.vllm.get_request_counts(),
            )
        sv = _stats(ov)
        sdd = _stats(od)
        if sv != sdd:
            raise _fail(self.p, step, "SchedulerStats (running, waiting, skipped)", sdd, sv)

    # ------------------------------------------------------------------ the runner

    def _rows_by_request(self, g: Any, spec: dict[str, list[int]]) -> dict[str, tuple[int, Any]]:
        bases = self._row_bases(g, spec)
        out = {}
        for rid, acceptable in zip(g.structured_output_request_ids, g.num_acceptable_drafts):
            n = len(spec.get(rid, ())) + 1
            out[rid] = (acceptable, g.grammar_bitmask[bases[rid] : bases[rid] + n])
        return out

    def _row_bases(self, gv: Any, spec: dict[str, list[int]]) -> dict[str, int]:
        bases, base = {}, 0
        stride = self.k + 1
        for rid in gv.structured_output_request_ids:
            bases[rid] = base
            base += len(spec.get(rid, ())) + 1 if self.packed_rows else stride
        return bases

    def _runner_output(self, so: Any, gv: Any) -> Any:
        rng = self.rng
        req_ids = list(so.num_scheduled_tokens)
        rng.shuffle(req_ids)
        spec = so.scheduled_spec_decode_tokens
        bases = self._row_bases(gv, spec) if gv is not None else {}
        acceptable = (
            dict(zip(gv.structured_output_request_ids, gv.num_acceptable_drafts))
            if gv is not None
            else {}
        )
        sampled = []
        for rid in req_ids:
            req = self.vllm.requests.get(rid)
            if req is None:  # finished while the step was in flight: its output is ignored
                sampled.append([int(rng.integers(FIRST_TOKEN, self.vocab))])
                continue
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = scheduled_drafts(so, rid)
            if rid in bases:
                mask, base = gv.grammar_bitmask, bases[rid]
                accepted = []
                for i, t in enumerate(drafts[: acceptable[rid]]):
                    if t not in allowed_tokens(mask[base + i]) or rng.random() < 0.3:
                        break
                    accepted.append(t)
                choices = allowed_tokens(mask[base + len(accepted)])
                choices = choices[choices < self.vocab]
                bonus = int(choices[int(rng.integers(0, len(choices)))])
            else:
                accepted = drafts[: int(rng.integers(0, len(drafts) + 1))]
                bonus = int(rng.integers(FIRST_TOKEN, self.vocab))
                if rng.random() < 0.04:
                    bonus = EOS
            sampled.append([*accepted, bonus])
        return runner_output(req_ids, sampled)

    def _grammar_drafts(self, rid: str, req: Any) -> list[int]:
        """K drafts walked through the request's grammar (vLLM's side: rolled back after),
        sometimes ending with an invalid token."""
        rng = self.rng
        grammar = req.structured_output_request.grammar
        backend = self.vllm.structured_output_manager.backend
        mask = backend.allocate_token_bitmask(1)
        drafts: list[int] = []
        advanced = 0
        for _ in range(self.k):
            if grammar.is_terminated():
                break
            grammar.fill_bitmask(mask, 0)
            choices = allowed_tokens(mask[0].numpy())
            choices = choices[choices < self.vocab]
            token = int(choices[int(rng.integers(0, len(choices)))])
            if rng.random() < 0.15:
                token = int(rng.integers(FIRST_TOKEN, self.vocab))
            drafts.append(token)
            if not grammar.validate_tokens([token]):
                self.res.invalid_drafts += 1
                break
            grammar.accept_tokens(rid, [token])
            advanced += 1
        if advanced:
            grammar.rollback(advanced)
        return drafts

    def _drafts(self, so: Any) -> Optional[Any]:
        if not self.k:
            return None

        def drafts_for(rid: str, req: Any) -> list[int]:
            if req.use_structured_output:
                return self._grammar_drafts(rid, req)
            return self.rng.integers(FIRST_TOKEN, self.vocab, self.k).tolist()

        return draft_token_ids(self.vllm, so, drafts_for)

    # ------------------------------------------------------------------ the loops

    def run(self) -> StructuredResult:
        if self.p.async_scheduling:
            self._run_async()
        else:
            self._run_sync()
        assert not self.vllm.requests and not self.ours.requests, "the trace did not drain"
        return self.res

    def _apply(self, step: int, sv: Any, sd: Any, mro: Any) -> None:
        ov = self.vllm.update_from_output(sv, mro)
        od = self.ours.update_from_output(sd, mro)
        self._compare_engine(step, ov, od)

    def _run_sync(self) -> None:
        p = self.p
        for step in range(p.max_steps):
            self._arrivals_and_aborts(step)
            if not self.vllm.has_requests() and self.next_id >= p.num_requests:
                break
            sv, sd = self.vllm.schedule(), self.ours.schedule()
            self._compare_schedule(step, sv, sd)
            gv = self._bitmasks(step, sv, sd)
            self._apply(step, sv, sd, self._runner_output(sv, gv))
            if sv.total_num_scheduled_tokens:
                drafts = self._drafts(sv)
                if drafts is not None:
                    self.vllm.update_draft_token_ids(copy.deepcopy(drafts))
                    self.ours.update_draft_token_ids(copy.deepcopy(drafts))
            self.res.steps = step + 1
            self.ours.core.check_invariants()

    def _run_async(self) -> None:
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

        p = self.p
        queue: deque[tuple[Any, Any, Any]] = deque()
        for step in range(p.max_steps):
            self._arrivals_and_aborts(step)
            deferred = None
            if self.vllm.has_requests():
                sv, sd = self.vllm.schedule(), self.ours.schedule()
                self._compare_schedule(step, sv, sd)
                executed = sv.total_num_scheduled_tokens > 0
                if not executed:
                    queue.appendleft((sv, sd, EMPTY_MODEL_RUNNER_OUTPUT))
                elif not sv.pending_structured_output_tokens:
                    gv = self._bitmasks(step, sv, sd)
                    queue.appendleft((sv, sd, self._runner_output(sv, gv)))
                else:
                    deferred = (sv, sd)
                if deferred is None and len(queue) < 2 and (executed or self.vllm.has_requests()):
                    self.res.steps = step + 1
                    continue
            elif not queue:
                if self.next_id >= p.num_requests:
                    break
                continue
            sv0, sd0, mro = queue.pop()
            self._apply(step, sv0, sd0, mro)
            if deferred is not None:
                sv, sd = deferred
                drafts = self._drafts(sv)
                if drafts is not None:
                    self.vllm.update_draft_token_ids_in_output(copy.deepcopy(drafts), sv)
                    self.ours.update_draft_token_ids_in_output(copy.deepcopy(drafts), sd)
                    a = {k: list(v) for k, v in sv.scheduled_spec_decode_tokens.items()}
                    b = {k: list(v) for k, v in sd.scheduled_spec_decode_tokens.items()}
                    if a != b or sv.num_invalid_spec_tokens != sd.num_invalid_spec_tokens:
                        raise _fail(
                            p,
                            step,
                            "update_draft_token_ids_in_output",
                            (b, sd.num_invalid_spec_tokens),
                            (a, sv.num_invalid_spec_tokens),
                        )
                gv = self._bitmasks(step, sv, sd)
                queue.appendleft((sv, sd, self._runner_output(sv, gv)))
            self.res.steps = step + 1
            self.ours.core.check_invariants()
        while queue:
            sv0, sd0, mro = queue.pop()
            self._apply(p.max_steps, sv0, sd0, mro)


def _error(o: Any) -> Optional[tuple[str, str]]:
    """An output's error, without the wall-clock stamp xgrammar puts in its messages (each side
    compiles its own grammar)."""
    error = getattr(o, "error", None)
    if error is None:
        return None
    return (error.code, re.sub(r"\[\d\d:\d\d:\d\d\] ", "", error.message))


def _stats(outs: dict[int, Any]) -> Optional[tuple[int, int, int]]:
    for eco in outs.values():
        s = eco.scheduler_stats
        if s is not None:
            return (s.num_running_reqs, s.num_waiting_reqs, s.num_skipped_waiting_reqs)
    return None


def completion_text(tokenizer: Any, tokens: list[int]) -> str:
    """A finished output's text, without its EOS (what ``support.structured.satisfies`` checks)."""
    return tokenizer.decode([t for t in tokens if t != EOS], skip_special_tokens=True)
