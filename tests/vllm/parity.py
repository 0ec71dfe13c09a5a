"""Lockstep driver: vLLM 0.33's ``Scheduler`` (or ``AsyncScheduler``) and ``DFlashRsScheduler``
on one seeded trace.

Both are built offline from the same ``VllmConfig``/``KVCacheConfig`` and get equal (but
separate) vLLM ``Request`` objects, the same fabricated ``ModelRunnerOutput`` each step (random
acceptance of the scheduled drafts plus a bonus token, sometimes EOS or a stop token), the same
drafts and the same aborts. After every call the two are compared field by field; the first
difference raises ``Divergence`` with the seed, the step and the field.

Fabrication follows what a real sampler does, so that the comparison is not distorted by
outputs a real engine never produces: no stop token below ``min_tokens`` (vLLM's logits
processors mask them; dflash-rs's stop check relies on that), drafts never hold stop tokens, and
a request samples only in steps that finish its prefill.

With ``async_scheduling`` the trace follows vLLM's engine loop for async scheduling
(``EngineCore.step_with_batch_queue`` with two batches): step N+1 is scheduled before the output
of step N is applied, the scheduled drafts are placeholders (``-1``) whose real values only the
model runner knows, and the runner never reports drafts to the scheduler.

With ``reset_prob``/``pause_prob`` the trace also calls, at seeded steps and between two engine
steps (where the engine runs its utility calls, so under async scheduling with steps in flight),
``reset_prefix_cache`` (mostly with ``reset_running_requests=True``) and ``set_pause_state``
(toggling between ``UNPAUSED`` and the states in ``pause_states``). These draws come from a
separate generator, so traces without them are unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

EOS = 2
STOP_TOKENS = (5, 7)
FIRST_TOKEN = 16  # prompt, draft and ordinary sampled tokens come from [16, VOCAB)
VOCAB = 32000


def use_v1_runner(requested: bool) -> bool:
    """Whether a trace runs on vLLM's V1 model runner: when asked, and always with vLLM 0.32,
    which builds no V2-runner config without a GPU (its Triton check needs an active driver)."""
    from dflash_rs.vllm._compat import installed

    return requested or not installed().v2_runner_without_gpu


@contextlib.contextmanager
def model_runner_env(v1_runner: bool) -> Iterator[None]:
    """``VLLM_USE_V2_MODEL_RUNNER`` set for the runner a trace uses (see ``use_v1_runner``)
    while its configs and schedulers are built, then restored."""
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0" if v1_runner else "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_USE_V2_MODEL_RUNNER"]
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved


def runner_output(req_ids: list[str], sampled: list[list[int]], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` of a batch in the runner's order ``req_ids``, with the
    ``sampled`` tokens of each (``fields``: its other fields, e.g. ``prompt_logprobs_dict``)."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
        **fields,
    )


def scheduled_drafts(so: Any, rid: str) -> list[int]:
    """The drafts step ``so`` scheduled for ``rid``, up to the first placeholder (``-1``: vLLM
    pads admissions; a real sampler rejects them)."""
    drafts = list(so.scheduled_spec_decode_tokens.get(rid, []))
    return drafts[: drafts.index(-1)] if -1 in drafts else drafts


def draft_token_ids(
    sched: Any, so: Any, drafts_for: Callable[[str, Any], list[int]]
) -> Optional[Any]:
    """vLLM's ``DraftTokenIds`` after step ``so``: ``drafts_for(rid, request)`` for each of its
    requests (in the step's order) that drafts, i.e. is in ``sched``, unfinished and past its
    prefill; None when none does."""
    from vllm.v1.outputs import DraftTokenIds

    ids, drafts = [], []
    for rid in so.num_scheduled_tokens:
        req = sched.requests.get(rid)
        if req is None or req.is_finished() or req.is_prefill_chunk:
            continue
        ids.append(rid)
        drafts.append(drafts_for(rid, req))
    return DraftTokenIds(ids, drafts) if ids else None


class Divergence(AssertionError):
    """The two schedulers disagreed."""


@dataclass
class TraceParams:
    """One seeded trace. Pool and budget are small so that chunked prefill, preemption and
    prefix hits all happen."""

    seed: int
    method: str = "none"
    k: int = 3
    num_blocks: int = 48
    block_size: int = 16
    max_model_len: int = 256
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    policy: str = "fcfs"
    num_requests: int = 24
    prefix_len: int = 40
    max_steps: int = 600
    abort_prob: float = 0.02
    eos_prob: float = 0.03
    arrival_prob: float = 0.3
    v1_runner: bool = False
    #: vLLM's AsyncScheduler and the async engine loop (two steps in flight).
    async_scheduling: bool = False
    #: Async: steps in flight at most (vLLM's ``max_concurrent_batches``: 2 for async
    #: scheduling, pipeline stages + 1 with the V2 model runner).
    batch_queue_size: int = 2
    #: Async only: chance that a step's placeholder drafts are rewritten with the runner's
    #: (``update_draft_token_ids_in_output``), some of them too short (padded with -1).
    rewrite_drafts_prob: float = 0.0
    #: Chance per step of a ``reset_prefix_cache`` call (3 in 4 with reset_running_requests).
    reset_prob: float = 0.0
    #: Chance per step of a pause-state change: from UNPAUSED to one of ``pause_states``, or
    #: back to UNPAUSED. The engine waits for a resume, so a trace resumes when it would idle.
    pause_prob: float = 0.0
    pause_states: tuple[str, ...] = ("PAUSED_NEW",)
    #: KV-cache events on (``kv_events_config``): every batch either publishes is compared,
    #: event by event. Odd seeds build dflash-rs's requests without the engine's block hasher,
    #: so that every hash it publishes is its own.
    kv_events: bool = False
    #: LoRA: vLLM's ``max_loras`` (0: no LoRA config) and the adapters requests draw from (a
    #: quarter of the requests use none).
    max_loras: int = 0
    num_adapters: int = 0
    #: Chance that a request asks for prompt logprobs (it then reads no prefix-cache hit).
    prompt_logprobs_prob: float = 0.0
    #: Chance that a request's prompt is given as embeddings (no token ids); those of the
    #: shared-prefix requests start with the prefix's embeddings.
    prompt_embeds_prob: float = 0.0
    #: ``schedule(throttle_prefills=...)`` as vLLM's DP engine core passes it: True on the
    #: steps whose counter is not a multiple of ``throttle_every`` (0: never), or at random
    #: with ``throttle_prob`` (own generator, so traces without it are unchanged).
    throttle_every: int = 0
    throttle_prob: float = 0.0
    #: Known dflash-rs divergences (see KNOWN_DIVERGENCES) to neutralise on the vLLM side.
    emulate: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


#: Differences between dflash-rs's Rust core and vLLM 0.33 found by these traces, not (yet)
#: listed as intended in docs/ARCHITECTURE.md; ``emulate`` would make vLLM behave like dflash-rs
#: on them so the rest of a trace can still be compared. Empty: the four found so far are fixed
#: ("cache-at-update": blocks of accepted drafts are registered at update time; "free-order":
#: requests finished in one step are freed in scheduling order; "pad-admission": an admission
#: with one token left is padded to 1 + K; "stop-trim": tokens discarded after a stop are taken
#: off num_computed_tokens before blocks are cached). test_divergences.py keeps repros.
KNOWN_DIVERGENCES: dict[str, str] = {}


@dataclass
class TraceResult:
    """What a trace went through (to check that it exercised the hard paths)."""

    steps: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    prefix_hit_admissions: int = 0
    resumed: int = 0
    spec_steps: int = 0
    max_running: int = 0
    #: Async: the most output placeholders a request had after a schedule().
    max_placeholders: int = 0
    #: Async: outputs applied to a request preempted while they were in flight.
    stale_outputs: int = 0
    #: Async: steps whose placeholder drafts were rewritten before their output.
    draft_rewrites: int = 0
    #: reset_prefix_cache calls, and requests they preempted.
    resets: int = 0
    reset_preempted: int = 0
    #: Outputs dropped because a reset preempted their request while they were in flight.
    dropped_outputs: int = 0
    #: Pause-state changes; steps scheduled under PAUSED_NEW while requests waited (held back);
    #: steps scheduled under PAUSED_ALL.
    pause_changes: int = 0
    held_back_steps: int = 0
    paused_all_steps: int = 0
    #: KV events: batches published, events by class name.
    kv_event_batches: int = 0
    kv_events: dict[str, int] = field(default_factory=dict)
    #: LoRA: steps whose admissions stopped at max_loras adapters while a request with another
    #: adapter waited; the most adapters among one step's requests.
    lora_limited_steps: int = 0
    max_step_adapters: int = 0
    #: Admissions of prompt-logprob requests whose prompt starts with the shared prefix (they
    #: must read no hit), and outputs that delivered prompt logprobs.
    prompt_logprob_admissions: int = 0
    prompt_logprob_outputs: int = 0
    #: Admissions of prompt-embedding requests, and of those with a prefix-cache hit.
    prompt_embeds_admissions: int = 0
    prompt_embeds_hits: int = 0
    #: Steps scheduled with throttle_prefills; a digest of every step's scheduled tokens (two
    #: traces of one seed differ iff some step did).
    throttled_steps: int = 0
    schedule_digest: str = ""


def _fail(p: TraceParams, step: int, what: str, ours: Any, vllm: Any) -> Divergence:
    return Divergence(
        f"seed={p.seed} method={p.method} K={p.k} policy={p.policy} step={step}: {what}\n"
        f"  vLLM:     {vllm!r}\n  dflash-rs: {ours!r}"
    )


def _tokens(tokens: Any) -> Any:
    """Token lists compare by value but print short: (length, digest)."""
    if tokens is None:
        return None
    t = tuple(tokens)
    return (len(t), hashlib.sha1(repr(t).encode()).hexdigest()[:10])


def _norm_new(reqs: list[Any]) -> dict[str, tuple]:
    return {
        r.req_id: (
            _tokens(r.prompt_token_ids),
            [list(b) for b in r.block_ids],
            r.num_computed_tokens,
            _tokens(r.prefill_token_ids),
        )
        for r in reqs
    }


def _norm_cached(c: Any) -> dict[str, tuple]:
    return {
        rid: (
            rid in c.resumed_req_ids,
            None if nb is None else [list(b) for b in nb],
            nc,
            no,
            _tokens(c.all_token_ids.get(rid)),
        )
        for rid, nb, nc, no in zip(
            c.req_ids, c.new_block_ids, c.num_computed_tokens, c.num_output_tokens
        )
    }


def compare_outputs(p: TraceParams, step: int, v: Any, d: Any) -> None:
    """Field by field, order-insensitive where vLLM's consumers are (dicts and sets keyed by
    request id; the batch order of dflash-rs is its persistent block-table order)."""
    checks = [
        ("num_scheduled_tokens", dict(v.num_scheduled_tokens), dict(d.num_scheduled_tokens)),
        ("total_num_scheduled_tokens", v.total_num_scheduled_tokens, d.total_num_scheduled_tokens),
        (
            "scheduled_spec_decode_tokens",
            {k: list(x) for k, x in v.scheduled_spec_decode_tokens.items()},
            {k: list(x) for k, x in d.scheduled_spec_decode_tokens.items()},
        ),
        ("scheduled_new_reqs", _norm_new(v.scheduled_new_reqs), _norm_new(d.scheduled_new_reqs)),
        (
            "scheduled_new_reqs order",
            [r.req_id for r in v.scheduled_new_reqs],
            [r.req_id for r in d.scheduled_new_reqs],
        ),
        (
            "scheduled_cached_reqs",
            _norm_cached(v.scheduled_cached_reqs),
            _norm_cached(d.scheduled_cached_reqs),
        ),
        ("finished_req_ids", set(v.finished_req_ids), set(d.finished_req_ids)),
        ("preempted_req_ids", set(v.preempted_req_ids or ()), set(d.preempted_req_ids or ())),
        (
            "num_spec_tokens_to_schedule",
            v.num_spec_tokens_to_schedule,
            d.num_spec_tokens_to_schedule,
        ),
        ("scheduled_encoder_inputs", v.scheduled_encoder_inputs, d.scheduled_encoder_inputs),
        ("num_common_prefix_blocks", v.num_common_prefix_blocks, d.num_common_prefix_blocks),
    ]
    for name, a, b in checks:
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                keys = sorted(set(a) | set(b))
                a = {k: a.get(k) for k in keys if a.get(k) != b.get(k)}
                b = {k: b.get(k) for k in keys if k in a}
            raise _fail(p, step, f"SchedulerOutput.{name}", b, a)


def _norm_engine(outs: dict[int, Any]) -> dict[str, tuple]:
    res = {}
    for client, eco in outs.items():
        for o in eco.outputs:
            res[o.request_id] = (
                client,
                list(o.new_token_ids),
                None if o.finish_reason is None else int(o.finish_reason),
                o.stop_reason,
                getattr(o, "new_prompt_logprobs_tensors", None),
            )
    return res


class EventRecorder:
    """Stands in for vLLM's event publisher: keeps every ``KVEventBatch`` published."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass

    def take(self) -> list[Any]:
        batches, self.batches = self.batches, []
        return batches


def _norm_batches(batches: list[Any]) -> list[tuple[Any, list[Any]]]:
    """Published batches without their timestamps: (data-parallel rank, events)."""
    return [(b.data_parallel_rank, list(b.events)) for b in batches]


class Lockstep:
    """Drives both schedulers through one trace."""

    def __init__(self, offline: Any, p: TraceParams) -> None:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler

        from dflash_rs.vllm import DFlashRsScheduler

        self.p = p
        self.offline = offline
        self.v1_runner = use_v1_runner(p.v1_runner)
        with model_runner_env(self.v1_runner):
            cls = AsyncScheduler if p.async_scheduling else Scheduler
            self._build(offline, p, cls, DFlashRsScheduler)
        self.rng = np.random.default_rng(p.seed)
        self.order_rng = np.random.default_rng(p.seed + 10_000)  # keeps self.rng's draws
        self.event_rng = np.random.default_rng(p.seed + 20_000)  # resets and pauses
        self.feature_rng = np.random.default_rng(p.seed + 30_000)  # LoRA, prompt logprobs
        self.throttle_rng = np.random.default_rng(p.seed + 40_000)  # throttle_prefills
        self.num_schedules = 0
        #: Prompt-logprob requests whose prompt logprobs the fabricated runner returned.
        self.prompt_logprobs_sent: set[str] = set()
        self.prefix = self.rng.integers(FIRST_TOKEN, VOCAB, p.prefix_len).tolist()
        self.next_id = 0
        self.res = TraceResult()
        self.k = self.vllm.num_spec_tokens
        unknown = set(p.emulate) - set(KNOWN_DIVERGENCES)
        assert not unknown, unknown

    def _build(self, offline: Any, p: TraceParams, Scheduler: type, Ours: type) -> None:
        extra = dict(p.extra)
        if p.kv_events:
            from vllm.config import KVEventsConfig

            # The null publisher: the trace puts a recorder in its place on both.
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            extra["vllm"] = {**extra.get("vllm", {}), "kv_events_config": events}
        if p.max_loras:
            from vllm.config import LoRAConfig

            lora = LoRAConfig(max_loras=p.max_loras, max_lora_rank=8)
            extra["vllm"] = {**extra.get("vllm", {}), "lora_config": lora}
        cfg, kv = offline.configs(
            num_blocks=p.num_blocks,
            method=p.method,
            num_speculative_tokens=p.k,
            block_size=p.block_size,
            max_model_len=p.max_model_len,
            max_num_seqs=p.max_num_seqs,
            max_num_batched_tokens=p.max_num_batched_tokens,
            policy=p.policy,
            async_scheduling=p.async_scheduling,
            **extra,
        )
        self.cfg = cfg
        self.vllm = offline.scheduler(Scheduler, cfg, kv)
        self.ours = offline.scheduler(Ours, cfg, kv)
        assert self.vllm.use_v2_model_runner == (not self.v1_runner)
        self.hasher = offline.block_hasher(cfg)
        self.our_hasher = self.hasher if p.kv_events and p.seed % 2 == 0 else None
        self.events = (EventRecorder(), EventRecorder())
        if p.kv_events:
            assert self.vllm.enable_kv_cache_events and self.ours.enable_kv_cache_events
            self.vllm.kv_event_publisher, self.ours.kv_event_publisher = self.events

    # ------------------------------------------------------------------ trace pieces

    def _new_request(self, step: int) -> None:
        p, rng = self.p, self.rng
        i = self.next_id
        self.next_id += 1
        n = int(rng.integers(8, p.max_model_len // 2))
        tail = rng.integers(FIRST_TOKEN, VOCAB, n).tolist()
        prompt = (self.prefix + tail)[: p.max_model_len - 1] if i % 2 == 0 else tail
        max_tokens = int(rng.integers(1, p.max_model_len // 2))
        sampling: dict[str, Any] = {
            "priority": int(rng.integers(0, 3)) if p.policy == "priority" else 0,
            "arrival_time": 1000.0 + i,
        }
        if rng.random() < 0.5:
            sampling["eos_token_id"] = EOS
        if rng.random() < 0.3:
            sampling["stop_token_ids"] = list(STOP_TOKENS)
        if rng.random() < 0.2:
            sampling["min_tokens"] = int(rng.integers(0, max_tokens + 1))
        if rng.random() < 0.1:
            sampling["ignore_eos"] = True
        sampling.update(self._features())
        rid = f"r{i}"
        embeds = None
        if p.prompt_embeds_prob and self.feature_rng.random() < p.prompt_embeds_prob:
            embeds = self._embeds(len(prompt), shared=i % 2 == 0)
        for sched, hasher in ((self.vllm, self.hasher), (self.ours, self.our_hasher)):
            extra = dict(sampling)
            if embeds is not None:
                extra["prompt_embeds"] = embeds.clone()
            tokens = None if embeds is not None else list(prompt)
            sched.add_request(self.offline.request(rid, tokens, max_tokens, hasher, **extra))

    def _embeds(self, n: int, shared: bool) -> Any:
        """A prompt of ``n`` embeddings (the offline model's hidden size, 64); a shared one
        starts with the trace's prefix embeddings."""
        import torch

        rng = self.feature_rng
        if not hasattr(self, "prefix_embeds"):
            self.prefix_embeds = rng.standard_normal((self.p.prefix_len, 64), np.float32)
        rows = rng.standard_normal((n, 64), np.float32)
        if shared:
            k = min(n, self.p.prefix_len)
            rows[:k] = self.prefix_embeds[:k]
        return torch.from_numpy(rows)

    def _features(self) -> dict[str, Any]:
        """A new request's LoRA adapter and prompt logprobs (drawn from their own generator,
        so traces without them are unchanged)."""
        p, rng = self.p, self.feature_rng
        out: dict[str, Any] = {}
        if p.num_adapters and rng.random() < 0.75:
            from vllm.lora.request import LoRARequest

            j = int(rng.integers(1, p.num_adapters + 1))
            out["lora_request"] = LoRARequest(f"adapter{j}", j, f"/adapters/{j}")
        if p.prompt_logprobs_prob and rng.random() < p.prompt_logprobs_prob:
            out["prompt_logprobs"] = int(rng.integers(0, 3))
        return out

    def _prompt_logprobs(
        self, req_ids: list[str], samples: Optional[dict[str, bool]] = None
    ) -> dict[str, Any]:
        """``prompt_logprobs_dict`` as vLLM's runner fills it: None while a prompt-logprob
        request's prompt is in chunks, its logprobs (here a tag) with the step that ends its
        prefill, nothing after."""
        out: dict[str, Any] = {}
        for rid in req_ids:
            req = self.vllm.requests.get(rid)
            if req is None or req.sampling_params.prompt_logprobs is None:
                continue
            if rid in self.prompt_logprobs_sent:
                continue
            in_chunks = req.is_prefill_chunk if samples is None else not samples[rid]
            if in_chunks:
                out[rid] = None
            else:
                out[rid] = f"prompt-logprobs-{rid}"
                self.prompt_logprobs_sent.add(rid)
        return out

    def _runner_output(self, so: Any) -> Any:
        rng, p = self.rng, self.p
        req_ids = list(so.num_scheduled_tokens)
        rng.shuffle(req_ids)  # the runner's batch order is its own
        sampled = []
        for rid in req_ids:
            req = self.vllm.requests[rid]
            if req.is_prefill_chunk:
                sampled.append([])
                continue
            drafts = scheduled_drafts(so, rid)
            accepted = drafts[: int(rng.integers(0, len(drafts) + 1))]
            position = req.num_output_tokens + len(accepted)
            params = req.sampling_params
            bonus = int(rng.integers(FIRST_TOKEN, VOCAB))
            if position >= params.min_tokens and rng.random() < p.eos_prob:
                choices = [EOS, *(params.stop_token_ids or [])]
                bonus = int(choices[int(rng.integers(0, len(choices)))])
            sampled.append([*accepted, bonus])
        return runner_output(req_ids, sampled, prompt_logprobs_dict=self._prompt_logprobs(req_ids))

    def _drafts(self, so: Any) -> Optional[Any]:
        if not self.k:
            return None

        def drafts_for(rid: str, req: Any) -> list[int]:
            n = self.k if self.p.method != "ngram" else int(self.rng.integers(0, self.k + 1))
            return self.rng.integers(FIRST_TOKEN, VOCAB, n).tolist()

        return draft_token_ids(self.vllm, so, drafts_for)

    # ------------------------------------------------------------------ the loop

    def run(self) -> TraceResult:
        if self.p.async_scheduling:
            return self._run_async()
        p, res = self.p, self.res
        initial = max(1, p.num_requests // 3)
        for _ in range(initial):
            self._new_request(0)
        for step in range(1, p.max_steps + 1):
            res.steps = step
            self._arrivals_and_aborts(step)
            self._pause_and_reset(step)
            self._compare_state(step, "before schedule")
            if not self.vllm.has_requests() and not self.ours.has_requests():
                if self.next_id >= p.num_requests and not self._resume_if_paused(step):
                    break
                continue
            self._account_pause()
            sv, sd = self._schedule_both()
            compare_outputs(p, step, sv, sd)
            self._account(sv)
            mro = self._runner_output(sv)
            self._apply(step, sv, sd, mro)
            drafts = self._drafts(sv)
            if drafts is not None:
                self.vllm.update_draft_token_ids(copy.deepcopy(drafts))
                mine = copy.deepcopy(drafts)
                if self.order_rng.random() < 0.5:
                    # The runner's order may be dflash-rs's batch order (its array path).
                    by_id = dict(zip(mine.req_ids, mine.draft_token_ids))
                    mine.req_ids = [r for r in sd.num_scheduled_tokens if r in by_id]
                    mine.draft_token_ids = [by_id[r] for r in mine.req_ids]
                self.ours.update_draft_token_ids(mine)
            self.ours.core.check_invariants()
            self._compare_state(step, "after update")
        return res

    def _schedule_both(self) -> tuple[Any, Any]:
        """``schedule(throttle_prefills)`` on both, the flag drawn as the engine would pass
        it."""
        p = self.p
        self.num_schedules += 1
        throttle = bool(p.throttle_every) and self.num_schedules % p.throttle_every != 0
        if p.throttle_prob:
            throttle = bool(self.throttle_rng.random() < p.throttle_prob)
        sv = self.vllm.schedule(throttle)
        sd = self.ours.schedule(throttle)
        self.res.throttled_steps += throttle
        step = repr(sorted(sv.num_scheduled_tokens.items()))
        digest = hashlib.sha1((self.res.schedule_digest + step).encode()).hexdigest()
        self.res.schedule_digest = digest
        return sv, sd

    def _arrivals_and_aborts(self, step: int) -> None:
        """Maybe a new request, maybe an abort of a live one (on both schedulers)."""
        from vllm.v1.request import RequestStatus

        p, rng = self.p, self.rng
        if self.next_id < p.num_requests and rng.random() < p.arrival_prob:
            self._new_request(step)
        if rng.random() < p.abort_prob and self.vllm.requests:
            live = sorted(self.vllm.requests)
            rid = live[int(rng.integers(0, len(live)))]
            a = [
                r.request_id for r in self.vllm.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            ]
            b = [
                r.request_id for r in self.ours.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            ]
            if a != b:
                raise _fail(p, step, "finish_requests", b, a)
            self.res.aborted += len(a)

    def _set_pause(self, step: int, name: str) -> None:
        from vllm.v1.core.sched.interface import PauseState

        state = PauseState[name]
        self.vllm.set_pause_state(state)
        self.ours.set_pause_state(state)
        if self.ours.pause_state != self.vllm.pause_state:
            raise _fail(self.p, step, "pause_state", self.ours.pause_state, self.vllm.pause_state)
        self.res.pause_changes += 1

    def _pause_and_reset(self, step: int) -> None:
        """Maybe a pause-state change, maybe a reset_prefix_cache (on both), compared."""
        p, rng = self.p, self.event_rng
        if not (p.pause_prob or p.reset_prob):
            return
        if rng.random() < p.pause_prob:
            if self.vllm.pause_state.name == "UNPAUSED":
                self._set_pause(step, p.pause_states[int(rng.integers(0, len(p.pause_states)))])
            else:
                self._set_pause(step, "UNPAUSED")
        if rng.random() < p.reset_prob:
            preempt = bool(rng.random() < 0.75)
            running = self.vllm.get_request_counts()[0]
            a = self.vllm.reset_prefix_cache(reset_running_requests=preempt)
            b = self.ours.reset_prefix_cache(reset_running_requests=preempt)
            if a != b:
                raise _fail(p, step, f"reset_prefix_cache({preempt})", b, a)
            self.res.resets += 1
            self.res.reset_preempted += running if preempt else 0
            self.ours.core.check_invariants()
            self._compare_state(step, "after reset_prefix_cache")

    def _resume_if_paused(self, step: int) -> bool:
        """The trace would idle with requests held back by a pause: resume (the engine would
        wait for a resume call). Whether it did."""
        if self.vllm.pause_state.name == "UNPAUSED" or not self.vllm.requests:
            return False
        self._set_pause(step, "UNPAUSED")
        return True

    def _account_pause(self) -> None:
        state = self.vllm.pause_state.name
        self.res.held_back_steps += state == "PAUSED_NEW" and bool(self.vllm.waiting)
        self.res.paused_all_steps += state == "PAUSED_ALL"

    def _apply(self, step: int, sv: Any, sd: Any, mro: Any) -> None:
        """update_from_output on both with the same runner output; compares what they return."""
        ov = self.vllm.update_from_output(sv, copy.deepcopy(mro))
        od = self.ours.update_from_output(sd, copy.deepcopy(mro))
        a, b = _norm_engine(ov), _norm_engine(od)
        if a != b:
            keys = sorted(set(a) | set(b))
            raise _fail(
                self.p,
                step,
                "EngineCoreOutputs",
                {k: b.get(k) for k in keys if a.get(k) != b.get(k)},
                {k: a.get(k) for k in keys if a.get(k) != b.get(k)},
            )
        self.res.finished += sum(1 for x in a.values() if x[2] is not None)
        self.res.prompt_logprob_outputs += sum(1 for x in a.values() if x[4] is not None)
        self._compare_stats(step, ov, od)
        self._compare_events(step)

    def _compare_events(self, step: int) -> None:
        """The KV-event batches both published in the last update_from_output, event by
        event."""
        if not self.p.kv_events:
            return
        a, b = (_norm_batches(r.take()) for r in self.events)
        self.res.kv_event_batches += len(a)
        for _, events in a:
            for e in events:
                name = type(e).__name__
                self.res.kv_events[name] = self.res.kv_events.get(name, 0) + 1
        if a != b:
            flat_a = [e for _, events in a for e in events]
            flat_b = [e for _, events in b for e in events]
            i = next(
                (i for i, (x, y) in enumerate(zip(flat_a, flat_b)) if x != y),
                min(len(flat_a), len(flat_b)),
            )
            raise _fail(
                self.p,
                step,
                f"KV events (batches {len(a)} vs {len(b)}, first difference at event {i})",
                flat_b[i : i + 2],
                flat_a[i : i + 2],
            )

    # ------------------------------------------------------------------ async scheduling

    def _run_async(self) -> TraceResult:
        """vLLM's ``step_with_batch_queue``: schedule a step; if the queue is not full (and there
        is work), return; otherwise apply the oldest step's output."""
        p, res = self.p, self.res
        for _ in range(max(1, p.num_requests // 3)):
            self._new_request(0)
        queue: deque[tuple[Any, Any, dict[str, tuple[bool, bool]]]] = deque()
        for step in range(1, p.max_steps + 1):
            res.steps = step
            self._arrivals_and_aborts(step)
            self._pause_and_reset(step)
            self._compare_state(step, "before schedule")
            if self.vllm.has_requests():
                self._account_pause()
                sv, sd = self._schedule_both()
                compare_outputs(p, step, sv, sd)
                self._account(sv)
                queue.append((sv, sd, self._sampling_plan(sv)))
                res.max_placeholders = max(
                    [res.max_placeholders]
                    + [r.num_output_placeholders for r in self.vllm.requests.values()]
                )
                self.ours.core.check_invariants()
                self._compare_state(step, "after schedule")
                executed = sv.total_num_scheduled_tokens > 0
                if len(queue) < p.batch_queue_size and (executed or self.vllm.has_requests()):
                    continue
            elif not queue:
                if self.next_id >= p.num_requests and not self._resume_if_paused(step):
                    break
                continue
            sv, sd, plan = queue.popleft()
            rewritten = self._maybe_rewrite_drafts(step, sv, sd)
            res.draft_rewrites += bool(rewritten)
            stale = [
                self.vllm.requests[rid]
                for rid in sv.num_scheduled_tokens
                if rid in self.vllm.requests and self.vllm.requests[rid].num_stale_output_tokens
            ]
            res.stale_outputs += len(stale)
            res.dropped_outputs += sum(r.drop_stale_output for r in stale)
            self._apply(step, sv, sd, self._async_runner_output(sv, plan, rewritten))
            self.ours.core.check_invariants()
            self._compare_state(step, "after update")
        return res

    def _sampling_plan(self, sv: Any) -> dict[str, tuple[bool, bool]]:
        """Per scheduled request, right after schedule(): (samples, admitted). A request samples
        iff the step finishes its prefill; an admission's drafts are padding the runner rejects
        (it has no drafts of its own for it yet)."""
        admitted = {r.req_id for r in sv.scheduled_new_reqs}
        admitted |= set(sv.scheduled_cached_reqs.resumed_req_ids)
        return {
            rid: (not self.vllm.requests[rid].is_prefill_chunk, rid in admitted)
            for rid in sv.num_scheduled_tokens
        }

    def _maybe_rewrite_drafts(self, step: int, sv: Any, sd: Any) -> dict[str, list[int]]:
        """Sometimes replaces the placeholder drafts in both outputs with the runner's
        (``update_draft_token_ids_in_output``), some too short; returns the rewritten lists."""
        from vllm.v1.outputs import DraftTokenIds

        rng, k = self.rng, self.k
        spec = sv.scheduled_spec_decode_tokens
        if not k or not spec or rng.random() >= self.p.rewrite_drafts_prob:
            return {}
        ids = sorted(spec)
        drafts = [
            rng.integers(FIRST_TOKEN, VOCAB, int(rng.integers(0, k + 1))).tolist() for _ in ids
        ]
        self.vllm.update_draft_token_ids_in_output(DraftTokenIds(ids, copy.deepcopy(drafts)), sv)
        self.ours.update_draft_token_ids_in_output(DraftTokenIds(ids, copy.deepcopy(drafts)), sd)
        pairs = [
            (
                "scheduled_spec_decode_tokens",
                {r: list(x) for r, x in sv.scheduled_spec_decode_tokens.items()},
                {r: list(x) for r, x in sd.scheduled_spec_decode_tokens.items()},
            ),
            ("num_invalid_spec_tokens", sv.num_invalid_spec_tokens, sd.num_invalid_spec_tokens),
        ]
        for name, a, b in pairs:
            if a != b:
                raise _fail(self.p, step, f"update_draft_token_ids_in_output: {name}", b, a)
        return {rid: list(spec[rid]) for rid in ids if rid in spec}

    def _async_runner_output(
        self, sv: Any, plan: dict[str, tuple[bool, bool]], rewritten: dict[str, list[int]]
    ) -> Any:
        """The runner's output for ``sv`` under async scheduling. Its drafts are the runner's
        own (the scheduler saw placeholders): it accepts any number of them, except an
        admission's padding; rewritten drafts are accepted up to the first invalid one."""
        rng, p = self.rng, self.p
        req_ids = list(sv.num_scheduled_tokens)
        rng.shuffle(req_ids)
        sampled = []
        for rid in req_ids:
            samples, admitted = plan[rid]
            if not samples:
                sampled.append([])
                continue
            n = len(sv.scheduled_spec_decode_tokens.get(rid, ()))
            if rid in rewritten:
                drafts = rewritten[rid]
                real = drafts[: drafts.index(-1)] if -1 in drafts else drafts
                accepted = real[: int(rng.integers(0, len(real) + 1))]
            elif admitted:
                accepted = []
            else:
                accepted = rng.integers(FIRST_TOKEN, VOCAB, int(rng.integers(0, n + 1))).tolist()
            bonus = int(rng.integers(FIRST_TOKEN, VOCAB))
            req = self.vllm.requests.get(rid)
            if req is not None and rng.random() < p.eos_prob:
                params = req.sampling_params
                if req.num_output_tokens + len(accepted) >= params.min_tokens:
                    choices = [EOS, *(params.stop_token_ids or [])]
                    bonus = int(choices[int(rng.integers(0, len(choices)))])
            sampled.append([*accepted, bonus])
        return runner_output(
            req_ids,
            sampled,
            prompt_logprobs_dict=self._prompt_logprobs(
                req_ids, {rid: plan[rid][0] for rid in req_ids}
            ),
        )

    def _account(self, sv: Any) -> None:
        res = self.res
        if self.p.max_loras:
            self._account_loras(sv)
        for r in sv.scheduled_new_reqs:
            params = r.sampling_params
            if r.prompt_embeds is not None:
                res.prompt_embeds_admissions += 1
                res.prompt_embeds_hits += r.num_computed_tokens > 0
            elif params.prompt_logprobs is not None and r.prompt_token_ids[:1] == self.prefix[:1]:
                res.prompt_logprob_admissions += 1
        res.preemptions += len(sv.preempted_req_ids or ())
        res.spec_steps += bool(sv.scheduled_spec_decode_tokens)
        res.max_running = max(res.max_running, self.vllm.get_request_counts()[0])
        for r in sv.scheduled_new_reqs:
            res.prefix_hit_admissions += r.num_computed_tokens > 0
            res.resumed += r.prefill_token_ids is not None and len(r.prefill_token_ids) > len(
                r.prompt_token_ids or []
            )
        res.resumed += len(sv.scheduled_cached_reqs.resumed_req_ids)

    def _account_loras(self, sv: Any) -> None:
        res, requests = self.res, self.vllm.requests
        adapters = {
            requests[rid].lora_request.lora_int_id
            for rid in sv.num_scheduled_tokens
            if requests[rid].lora_request is not None
        }
        res.max_step_adapters = max(res.max_step_adapters, len(adapters))
        if len(adapters) == self.p.max_loras and any(
            r.lora_request is not None and r.lora_request.lora_int_id not in adapters
            for r in self.vllm.waiting
        ):
            res.lora_limited_steps += 1

    def _compare_state(self, step: int, when: str) -> None:
        v, d, p = self.vllm, self.ours, self.p
        pairs = [
            ("get_request_counts", v.get_request_counts(), d.get_request_counts()),
            (
                "get_num_unfinished_requests",
                v.get_num_unfinished_requests(),
                d.get_num_unfinished_requests(),
            ),
            ("has_finished_requests", v.has_finished_requests(), d.has_finished_requests()),
            ("has_requests", v.has_requests(), d.has_requests()),
            ("requests", sorted(v.requests), sorted(d.requests)),
            (
                "get_kv_cache_usage",
                round(v.get_kv_cache_usage(), 9),
                round(d.get_kv_cache_usage(), 9),
            ),
        ]
        for name, a, b in pairs:
            if a != b:
                raise _fail(p, step, f"{name} ({when})", b, a)
        core = d.core
        for rid, req in v.requests.items():
            mine = d.requests[rid]
            got = (
                core.num_computed_tokens(rid),
                core.num_output_placeholders(rid),
                str(mine.status),
                mine.num_preemptions,
            )
            want = (
                req.num_computed_tokens,
                req.num_output_placeholders,
                str(req.status),
                req.num_preemptions,
            )
            if got != want:
                raise _fail(
                    p,
                    step,
                    f"request {rid} (computed, placeholders, status, preemptions) ({when})",
                    got,
                    want,
                )
            if core.all_token_ids(rid) != list(req.all_token_ids):
                raise _fail(
                    p,
                    step,
                    f"request {rid} all_token_ids ({when})",
                    core.all_token_ids(rid),
                    list(req.all_token_ids),
                )

    def _compare_stats(self, step: int, ov: dict[int, Any], od: dict[int, Any]) -> None:
        def _prefix_counters(p: Any) -> tuple[int, ...]:
            names = ("requests", "queries", "hits")
            return tuple(getattr(p, n) for n in names) + tuple(
                getattr(p, f"preempted_{n}") for n in names
            )

        def stats(outs: dict[int, Any]) -> Any:
            s = next((e.scheduler_stats for e in outs.values() if e.scheduler_stats), None)
            if s is None:
                return None
            sd = s.spec_decoding_stats
            return (
                s.num_running_reqs,
                s.num_waiting_reqs,
                s.num_skipped_waiting_reqs,
                round(s.kv_cache_usage, 9),
                s.prefix_cache_stats.reset,
                _prefix_counters(s.prefix_cache_stats),
                None
                if sd is None
                else (
                    sd.num_drafts,
                    sd.num_draft_tokens,
                    sd.num_accepted_tokens,
                    list(sd.num_accepted_tokens_per_pos),
                    list(sd.num_draft_tokens_per_pos),
                ),
            )

        a, b = stats(ov), stats(od)
        if a != b:
            raise _fail(self.p, step, "SchedulerStats", b, a)
