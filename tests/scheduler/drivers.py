"""Shared drivers for the scheduler tests: step checks, model-runner fakes, the ownership checker.

Everything here is written from the contract (DESIGN section 3, reference sections 3-4 and 7),
not from the implementation: the lookahead table, the ownership check and the per-step
consistency checks are computed from the public outputs only, so they can disagree with the
scheduler's own ``check_invariants()``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import numpy as np

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig
from support.arithmetic import cdiv

#: Slots past the scheduled tokens that each method's drafter writes in the same step, for K
#: speculative tokens (DESIGN section 3; reference section 4.4).
_LOOKAHEAD_PER_METHOD = {
    None: lambda k: 0,
    "ngram": lambda k: 0,
    "suffix": lambda k: 0,
    "eagle": lambda k: k,
    "eagle3": lambda k: k,
    "mtp": lambda k: k,
    "draft_model": lambda k: k,
    "dflash": lambda k: k + 1,
}

ALL_METHODS: Sequence[Optional[str]] = tuple(_LOOKAHEAD_PER_METHOD)
SPEC_METHODS: Sequence[str] = tuple(m for m in ALL_METHODS if m is not None)
LOOKAHEAD_METHODS: Sequence[str] = ("dflash", "eagle", "eagle3", "mtp", "draft_model")


def required_lookahead(method: Optional[str], k: int) -> int:
    """The lookahead the ownership contract requires (the correct table)."""
    return _LOOKAHEAD_PER_METHOD[method](k)


def make_scheduler(
    num_blocks: int = 1000,
    *,
    method: Optional[str] = None,
    k: int = 0,
    **kwargs: Any,
) -> Scheduler:
    """A scheduler of ``num_blocks`` blocks. Unless given, ``max_model_len`` is the longest
    sequence the pool holds, up to vLLM's 8192: a pool that cannot hold one ``max_model_len``
    request is refused."""
    speculative = None if method is None else SpeculativeConfig(method, k)
    kwargs.setdefault("max_model_len", pool_max_model_len(num_blocks, kwargs.get("block_size", 16)))
    return Scheduler(SchedulerConfig(num_blocks, speculative=speculative, **kwargs))


def pool_max_model_len(num_blocks: int, block_size: int = 16) -> int:
    """The longest ``max_model_len`` a pool holds (the null block excluded), up to 8192."""
    return min(8192, max(2, (num_blocks - 1) * block_size))


def make_requests(
    num_requests: int,
    num_tokens: int = 10,
    max_tokens: int = 16,
    *,
    start: int = 0,
    same_prompt: bool = False,
    **kwargs: Any,
) -> List[Request]:
    """vLLM's ``create_requests``: ids "0", "1", ...; prompt i is ``[i] * num_tokens``."""
    return [
        Request(
            str(i),
            [0 if same_prompt else i] * num_tokens,
            max_tokens,
            arrival_time=float(i),
            **kwargs,
        )
        for i in range(start, start + num_requests)
    ]


# ---------------------------------------------------------------------------------------------
# per-step checks


def check_block_table(sched: Scheduler, out: Any) -> None:
    """Row i of the block table is block_ids(req_ids[i]) followed by zeros."""
    table = out.block_table
    counts = out.num_blocks_per_row
    n = len(out.req_ids)
    assert table.dtype == np.int32 and counts.dtype == np.int32
    assert table.ndim == 2 and table.shape[0] == n
    assert counts.shape == (n,)
    assert not table.flags.writeable and not counts.flags.writeable
    for i, rid in enumerate(out.req_ids):
        blocks = sched.block_ids(rid)
        c = int(counts[i])
        assert c == len(blocks), (rid, c, blocks)
        assert table[i, :c].tolist() == blocks, (rid, table[i, :c].tolist(), blocks)
        assert not table[i, c:].any(), f"row {i} ({rid}) has stale ids past its count"
        assert 0 not in blocks


def check_step_arrays(sched: Scheduler, out: Any) -> None:
    """The batch-ordered arrays agree with each other and with the scheduler right after
    schedule() (which advances num_computed_tokens optimistically)."""
    n = len(out.req_ids)
    assert len(set(out.req_ids)) == n
    ns = out.num_scheduled_tokens_array
    nc = out.num_computed_tokens
    qsl = out.query_start_loc
    chunk = out.is_prefill_chunk
    assert ns.shape == (n,) and nc.shape == (n,) and chunk.shape == (n,)
    assert qsl.tolist() == [0, *np.cumsum(ns).tolist()]
    assert out.total_num_scheduled_tokens == int(ns.sum())
    assert out.num_scheduled_tokens == dict(zip(out.req_ids, ns.tolist()))
    assert all(x > 0 for x in ns.tolist())
    assert len(out) == n
    for i, rid in enumerate(out.req_ids):
        num_tokens = len(sched.all_token_ids(rid))
        computed_after = sched.num_computed_tokens(rid)
        assert computed_after == int(nc[i]) + int(ns[i]), rid
        assert bool(chunk[i]) == (computed_after < num_tokens), rid
        spec = out.scheduled_spec_decode_tokens.get(rid, [])
        assert len(spec) == max(0, computed_after - num_tokens), (rid, spec, num_tokens)
        assert sched.request_status(rid) == "running"
    new_ids = [r.req_id for r in out.scheduled_new_reqs]
    cached = out.scheduled_cached_reqs
    # New and resumed requests are NewRequestData; running and resumed ones CachedRequestData
    # (resumed ones in both, their new_block_ids replacing the worker's row).
    resumed = {r.req_id for r in out.scheduled_new_reqs if r.resumed}
    assert set(cached.resumed_req_ids) == resumed
    assert set(new_ids) | set(cached.req_ids) == set(out.req_ids)
    assert set(new_ids) & set(cached.req_ids) == resumed
    for r in out.scheduled_new_reqs:
        i = out.req_ids.index(r.req_id)
        assert r.block_ids == sched.block_ids(r.req_id)
        assert r.num_computed_tokens == int(nc[i])
        assert r.all_token_ids == sched.all_token_ids(r.req_id)
        assert r.all_token_ids[: len(r.prompt_token_ids)] == list(r.prompt_token_ids)
    for rid, new_blocks, computed in zip(
        cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
    ):
        i = out.req_ids.index(rid)
        assert computed == int(nc[i])
        blocks = sched.block_ids(rid)
        if rid in resumed:
            assert new_blocks == blocks
        elif new_blocks is not None:
            assert len(new_blocks) > 0 and blocks[-len(new_blocks) :] == new_blocks


def ownership_violations(
    sched: Scheduler,
    out: Any,
    *,
    lookahead: int,
    block_size: int,
    max_model_len: int,
) -> List[str]:
    """The ownership contract, checked from the step's arrays only.

    For every scheduled request i, every position p < min(num_computed[i] + num_scheduled[i] +
    lookahead, max_model_len) must map to block-table column p // block_size inside the row's
    count, and that column must hold a non-null block the request owns. Lookahead positions (at
    or past num_computed + num_scheduled) must also lie in blocks no other running request holds:
    they are the drafter's scratch slots, and are never full cached blocks.
    """
    violations: List[str] = []
    table = np.array(out.block_table, copy=True)
    counts = out.num_blocks_per_row.tolist()
    nc = out.num_computed_tokens.tolist()
    ns = out.num_scheduled_tokens_array.tolist()
    holders: Dict[int, Set[str]] = {}
    for rid in sched.running_request_ids():
        for b in sched.block_ids(rid):
            holders.setdefault(b, set()).add(rid)
    for i, rid in enumerate(out.req_ids):
        owned = set(sched.block_ids(rid))
        end_main = nc[i] + ns[i]
        end = min(end_main + lookahead, max_model_len)
        for col in range(cdiv(end, block_size)):
            first = col * block_size
            if col >= counts[i]:
                violations.append(
                    f"ownership: {rid!r} writes position {first} (column {col}) but its row "
                    f"has {counts[i]} blocks (num_computed={nc[i]}, scheduled={ns[i]}, "
                    f"lookahead={lookahead}, block_size={block_size})"
                )
                break
            block = int(table[i, col])
            if block == 0 or block not in owned:
                violations.append(
                    f"ownership: {rid!r} column {col} holds block {block}, not one of its "
                    f"blocks {sorted(owned)}"
                )
                continue
            last = min(first + block_size, end) - 1
            if last >= end_main and holders.get(block, set()) - {rid}:
                violations.append(
                    f"ownership: lookahead block {block} of {rid!r} is also held by "
                    f"{sorted(holders[block] - {rid})}"
                )
    return violations


# ---------------------------------------------------------------------------------------------
# fake model runner


def sampled_for(
    out: Any,
    rng: random.Random,
    *,
    accept: Any = "random",
    vocab: int = 50,
    token_for_chunks: bool = False,
) -> List[List[int]]:
    """Per batch entry: accepted drafts + a bonus token ([] for prefill chunks, or one token that
    the scheduler must discard when ``token_for_chunks``). ``accept`` is "random", "all",
    "none", or a callable (rid, drafts) -> number accepted."""
    result: List[List[int]] = []
    for i, rid in enumerate(out.req_ids):
        if out.is_prefill_chunk[i]:
            result.append([rng.randrange(vocab)] if token_for_chunks else [])
            continue
        drafts = out.scheduled_spec_decode_tokens.get(rid, [])
        # A model never accepts a placeholder draft (-1, a padded admission), nor any after it.
        real = next((j for j, t in enumerate(drafts) if t < 0), len(drafts))
        if callable(accept):
            n = accept(rid, drafts)
        elif accept == "all":
            n = len(drafts)
        elif accept == "none":
            n = 0
        else:
            n = rng.randint(0, len(drafts))
        n = min(n, real)
        result.append([*drafts[:n], rng.randrange(vocab)])
    return result


@dataclass
class StepResult:
    out: Any
    sampled: List[List[int]]
    results: List[Any]


@dataclass
class Tracker:
    """Cross-step bookkeeping: finished ids are reported exactly once, RequestOutputs match
    what was sampled, and token counts grow by what was accepted."""

    pending_finished: Set[str] = field(default_factory=set)
    reported_finished: Set[str] = field(default_factory=set)
    finish_reasons: Dict[str, str] = field(default_factory=dict)
    outputs: Dict[str, List[int]] = field(default_factory=dict)
    prompts: Dict[str, List[int]] = field(default_factory=dict)

    def on_schedule(self, out: Any) -> None:
        finished = set(out.finished_req_ids)
        again = finished & self.reported_finished
        assert not again, f"finished ids reported twice: {sorted(again)}"
        assert finished == self.pending_finished, (finished, self.pending_finished)
        self.reported_finished |= finished
        self.pending_finished = set()
        assert not (set(out.req_ids) & self.reported_finished)
        for r in out.scheduled_new_reqs:
            self.prompts.setdefault(r.req_id, list(r.prompt_token_ids))

    def on_finish_requests(self, ids: Iterable[str], reason: str) -> None:
        for rid in ids:
            assert rid not in self.pending_finished and rid not in self.reported_finished
            self.pending_finished.add(rid)
            self.finish_reasons[rid] = reason

    def on_update(
        self,
        sched: Scheduler,
        out: Any,
        sampled: List[List[int]],
        results: List[Any],
        before: Dict[str, List[int]],
        aborted: Set[str],
    ) -> None:
        by_id = {r.request_id: r for r in results}
        assert len(by_id) == len(results)
        expected_ids = [
            rid
            for i, rid in enumerate(out.req_ids)
            if not out.is_prefill_chunk[i] and sampled[i] and rid not in aborted
        ]
        assert [r.request_id for r in results] == expected_ids
        for i, rid in enumerate(out.req_ids):
            if rid not in by_id:
                if rid not in aborted:
                    assert sched.all_token_ids(rid) == before[rid], rid
                continue
            r = by_id[rid]
            got = list(r.new_token_ids)
            assert got == sampled[i][: len(got)] and got, (rid, got, sampled[i])
            self.outputs.setdefault(rid, []).extend(got)
            if r.finished:
                assert r.finish_reason in ("stop", "length"), r.finish_reason
                assert not sched.has_request(rid)
                self.pending_finished.add(rid)
                self.finish_reasons[rid] = r.finish_reason
                if r.stop_reason is not None:
                    assert r.finish_reason == "stop" and r.stop_reason == got[-1]
            else:
                assert got == sampled[i], (rid, got, sampled[i])
                assert r.finish_reason is None and r.stop_reason is None
                tokens = sched.all_token_ids(rid)
                assert tokens == before[rid] + got
                # Invariant 22: after a synchronous decode step, computed == num_tokens - 1.
                assert sched.num_computed_tokens(rid) == len(tokens) - 1


def apply_output(
    sched: Scheduler,
    out: Any,
    sampled: List[List[int]],
    rng: random.Random,
    *,
    k: int = 0,
    drafts: str = "none",
    vocab: int = 50,
) -> List[Any]:
    """update_from_output with drafts delivered one of several ways:
    "none", "runner" (ModelRunnerOutput.draft_token_ids), "dict", "arrays", or "random"."""
    mode = drafts
    if mode == "random":
        mode = rng.choice(["runner", "dict", "arrays", "runner"])
    proposals = [[rng.randrange(vocab) for _ in range(rng.randint(0, k))] for _ in out.req_ids]
    if mode == "runner":
        runner = ModelRunnerOutput(out.req_ids, sampled, draft_token_ids=proposals)
    elif rng.random() < 0.5:
        runner = ModelRunnerOutput(out.req_ids, sampled)
    else:
        flat = np.array([t for s in sampled for t in s], dtype=np.int64)
        runner = ModelRunnerOutput.from_arrays(
            list(out.req_ids), flat, np.array([len(s) for s in sampled], dtype=np.int32)
        )
    results = sched.update_from_output(out, runner)
    if mode == "dict":
        sched.update_draft_token_ids(dict(zip(out.req_ids, proposals)))
    elif mode == "arrays":
        flat = np.array([t for p in proposals for t in p], dtype=np.int32)
        counts = np.array([len(p) for p in proposals], dtype=np.int64)
        sched.update_draft_token_ids_from_arrays(out, flat, counts)
    return results


def run_step(
    sched: Scheduler,
    rng: random.Random,
    tracker: Optional[Tracker] = None,
    *,
    k: int = 0,
    accept: Any = "random",
    drafts: str = "none",
    vocab: int = 50,
    token_for_chunks: bool = False,
) -> StepResult:
    """schedule() + checks + a fake model output + update_from_output + checks."""
    out = sched.schedule()
    check_block_table(sched, out)
    check_step_arrays(sched, out)
    if tracker is not None:
        tracker.on_schedule(out)
    sampled = sampled_for(out, rng, accept=accept, vocab=vocab, token_for_chunks=token_for_chunks)
    before = {rid: sched.all_token_ids(rid) for rid in out.req_ids}
    results = apply_output(sched, out, sampled, rng, k=k, drafts=drafts, vocab=vocab)
    if tracker is not None:
        if token_for_chunks:
            sampled = [[] if c else s for c, s in zip(out.is_prefill_chunk, sampled)]
        tracker.on_update(sched, out, sampled, results, before, set())
    sched.check_invariants()
    return StepResult(out, sampled, results)


def assert_scheduler_empty(sched: Scheduler, num_blocks: int) -> None:
    """vLLM's ``assert_scheduler_empty``: no request anywhere, every usable block free."""
    assert not sched.has_unfinished_requests()
    assert sched.get_num_unfinished_requests() == 0
    assert sched.get_request_counts() == (0, 0)
    assert sched.running_request_ids() == [] and sched.waiting_request_ids() == []
    assert sched.num_free_blocks == num_blocks - 1
    assert sched.kv_cache_usage == 0.0
    sched.check_invariants()
