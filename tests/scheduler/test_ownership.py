"""The ownership contract (DESIGN section 3), checked after every schedule() on random workloads.

For every scheduled request r, every position p < min(num_computed(r) + num_scheduled(r) +
lookahead(method), max_model_len) must lie in a block-table column inside r's row count, holding
a non-null block r owns; lookahead blocks must not be shared with another running request. The
check (``drivers.ownership_violations``) reads only the step's arrays and ``block_ids()``; the
lookahead comes from the test's own table (DFlash K+1; EAGLE/EAGLE3/MTP/draft model K; n-gram,
suffix, none 0), not from the scheduler. ``check_invariants()`` must agree.

The same property run under the legacy lookahead policies (no lookahead on first prefill, as
vLLM <= 0.22; K instead of K+1 for DFlash) must fail: that is what shows the check can fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from dflash_rs import (
    InvariantError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
)
from support.arithmetic import cdiv

from .drivers import (
    ALL_METHODS,
    LOOKAHEAD_METHODS,
    Tracker,
    apply_output,
    assert_scheduler_empty,
    check_block_table,
    check_step_arrays,
    make_scheduler,
    ownership_violations,
    required_lookahead,
    sampled_for,
)

MAX_STEPS = 90
VOCAB = 50
#: Token sources for prompts: prompts are prefixes of these (plus a private tail), so prompts
#: that share a source share a prefix and hit each other's cached blocks.
_SOURCES = [[random.Random(s).randrange(VOCAB) for _ in range(512)] for s in range(3)]


@dataclass(frozen=True)
class Req:
    arrival_step: int
    request: Request


@dataclass(frozen=True)
class Workload:
    method: Optional[str]
    k: int
    block_size: int
    max_model_len: int
    num_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    policy: str
    requests: Sequence[Req]
    seed: int
    accept: str
    abort_prob: float
    pad_admitted_decodes: bool = False

    def config(self, lookahead_policy: str) -> SchedulerConfig:
        return SchedulerConfig(
            self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            speculative=None if self.method is None else SpeculativeConfig(self.method, self.k),
            lookahead_policy=lookahead_policy,
            pad_admitted_decodes=self.pad_admitted_decodes,
        )


@st.composite
def prompt_lengths(draw: Any, block_size: int, longest: int, lookahead: int) -> int:
    """Any length, or one just below/at a block boundary (where prompt + lookahead crosses into
    the next block), or one near the longest allowed (where lookahead gets capped)."""
    kind = draw(st.sampled_from(["short", "short", "any", "boundary", "boundary", "near_max"]))
    if kind == "short":
        return draw(st.integers(1, max(1, longest // 3)))
    if kind == "any":
        return draw(st.integers(1, longest))
    if kind == "boundary":
        m = draw(st.integers(1, max(1, cdiv(longest // 2, block_size))))
        n = m * block_size - draw(st.integers(0, lookahead + 1))
    else:
        n = longest - draw(st.integers(0, lookahead + 2))
    return min(max(n, 1), longest)


@st.composite
def workloads(draw: Any, methods: Sequence[Optional[str]] = ALL_METHODS) -> Workload:
    method = draw(st.sampled_from(list(methods)))
    k = 0 if method is None else draw(st.integers(1, 15))
    lookahead = required_lookahead(method, k)
    block_size = draw(st.sampled_from([1, 4, 16, 32]))
    max_model_len = draw(st.integers(8, 24 if block_size == 1 else 160))
    chunked = draw(st.sampled_from([True, True, True, False]))
    if chunked:
        budget = draw(st.sampled_from([1, 2, 3, 5, 8, 13, 16, 24, 40, 64, 512]))
    else:
        budget = draw(st.integers(max_model_len, max_model_len + 40))
    threshold = draw(st.sampled_from([0, 0, 0, 1, 4, 9, 17]))
    # A request of max_model_len tokens must fit alone, or the workload could wedge; beyond
    # that the pool is often tiny, so preemption is common.
    min_blocks = cdiv(max_model_len, block_size) + 1
    extra = draw(st.sampled_from([0, 0, 1, 2, min_blocks, 3 * min_blocks]))
    caching = draw(st.sampled_from([True, True, False]))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    # A prompt of exactly max_model_len tokens that is split into chunks never finishes: the
    # running path caps every step at max_model_len - 1 - num_computed (vLLM does the same), so
    # its last prompt token is never scheduled. Such prompts only come unsplit.
    longest = max_model_len if not chunked and not threshold else max_model_len - 1
    requests = []
    for i in range(draw(st.integers(1, 7))):
        n = draw(prompt_lengths(block_size, longest, lookahead))
        source = _SOURCES[draw(st.integers(0, len(_SOURCES) - 1))]
        shared = draw(st.sampled_from([n, n, 0, n // 2, n - 1]))
        prompt = source[:shared] + [VOCAB + i] * (n - shared)
        max_tokens = draw(st.integers(1, 40))
        requests.append(
            Req(
                draw(st.sampled_from([0, 0, 1, 2, 5, 12])),
                Request(
                    f"r{i}",
                    prompt,
                    max_tokens,
                    eos_token_id=draw(st.one_of(st.none(), st.integers(0, VOCAB - 1))),
                    stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=2)),
                    ignore_eos=draw(st.booleans()),
                    min_tokens=draw(st.integers(0, min(3, max_tokens))),
                    priority=draw(st.integers(0, 3)),
                    arrival_time=float(i),
                    cache_salt=draw(st.sampled_from([None, None, None, "salt"])),
                ),
            )
        )
    return Workload(
        method=method,
        k=k,
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=min_blocks + extra,
        max_num_seqs=draw(st.sampled_from([1, 2, 3, 4, 6, 8])),
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        policy=policy,
        requests=sorted(requests, key=lambda r: r.arrival_step),
        seed=draw(st.integers(0, 2**32 - 1)),
        accept=draw(st.sampled_from(["random", "random", "all", "none"])),
        abort_prob=draw(st.sampled_from([0.0, 0.0, 0.04])),
        pad_admitted_decodes=draw(st.booleans()),
    )


@dataclass
class Report:
    violations: List[str] = field(default_factory=list)
    invariant_errors: List[str] = field(default_factory=list)
    steps: int = 0
    stats: Dict[str, Any] = field(default_factory=dict)
    prefix_hit_admissions: int = 0


def check_schedule_rules(
    sched: Scheduler,
    out: Any,
    wl: Workload,
    prev_running: List[str],
    prev_waiting: List[str],
    keys: Dict[str, tuple],
    ever_preempted: Set[str],
) -> None:
    """Budget, limits, preemption and admission rules of one step (reference 3.2-3.3, 7)."""
    ns = out.num_scheduled_tokens
    assert out.total_num_scheduled_tokens <= wl.max_num_batched_tokens
    assert len(sched.running_request_ids()) <= wl.max_num_seqs
    if wl.long_prefill_token_threshold:
        assert max(ns.values(), default=0) <= wl.long_prefill_token_threshold
    preempted = set(out.preempted_req_ids)
    assert not preempted & set(out.req_ids)
    if preempted:
        # No waiting request is admitted in a step that preempted.
        assert list(out.scheduled_new_reqs) == []
        remaining = [r for r in prev_running if r not in preempted]
        if wl.policy == "fcfs":
            # The victim is always the last running request.
            assert prev_running[len(remaining) :] == sorted(preempted, key=prev_running.index), (
                prev_running,
                preempted,
            )
            assert set(sched.waiting_request_ids()[: len(preempted)]) == preempted
        else:
            # Each victim was the max (priority, arrival) among requests still running.
            assert min(keys[r] for r in preempted) > max(
                (keys[r] for r in remaining), default=(-1, -1.0)
            )
    for rid in preempted:
        assert sched.request_status(rid) == "preempted"
        assert sched.num_computed_tokens(rid) == 0
        assert sched.block_ids(rid) == []
    admitted = [r.req_id for r in out.scheduled_new_reqs]
    # Strict queue-order admission: the admitted requests are the head of the waiting queue.
    assert admitted == prev_waiting[: len(admitted)], (admitted, prev_waiting)
    for r in out.scheduled_new_reqs:
        assert r.resumed == (r.req_id in ever_preempted)
        hits = r.num_computed_tokens
        assert hits % wl.block_size == 0 and hits <= len(r.all_token_ids) - 1
        if not wl.enable_prefix_caching:
            assert hits == 0
    resumed = set(out.scheduled_cached_reqs.resumed_req_ids)
    for i, rid in enumerate(out.req_ids):
        if rid in prev_running and rid not in resumed:
            # Running requests: a decode step keeps every input position <= max_model_len - 2
            # (room for the sampled token); a prefill chunk may run to the end of the known
            # tokens (vLLM caps it too, and a prompt of exactly max_model_len then never ends).
            end = int(out.num_computed_tokens[i]) + ns[rid]
            if out.is_prefill_chunk[i] or end <= len(sched.all_token_ids(rid)):
                assert end <= wl.max_model_len
            else:
                assert end <= wl.max_model_len - 1


def simulate(wl: Workload, lookahead_policy: str = "correct") -> Report:
    """Runs the workload for up to MAX_STEPS steps, checking every step; then aborts what is
    left and checks that the pool is whole again."""
    report = Report()
    sched = Scheduler(wl.config(lookahead_policy))
    rng = random.Random(wl.seed)
    tracker = Tracker()
    lookahead = required_lookahead(wl.method, wl.k)
    assert sched.required_lookahead_tokens == lookahead
    if lookahead_policy == "correct":
        assert sched.lookahead_tokens == lookahead
    keys: Dict[str, Any] = {}
    ever_preempted: Set[str] = set()
    pending = list(wl.requests)

    def check_invariants() -> None:
        try:
            sched.check_invariants()
        except InvariantError as e:
            report.invariant_errors.append(f"step {report.steps}: {e}")

    for step in range(MAX_STEPS):
        report.steps = step
        while pending and pending[0].arrival_step <= step:
            req = pending.pop(0).request
            sched.add_request(req)
            keys[req.request_id] = (req.priority, req.arrival_time)
        prev_running = sched.running_request_ids()
        prev_waiting = sched.waiting_request_ids()
        out = sched.schedule()
        check_block_table(sched, out)
        check_step_arrays(sched, out)
        tracker.on_schedule(out)
        check_schedule_rules(sched, out, wl, prev_running, prev_waiting, keys, ever_preempted)
        ever_preempted |= set(out.preempted_req_ids)
        report.prefix_hit_admissions += sum(
            1 for r in out.scheduled_new_reqs if r.num_computed_tokens > 0
        )
        report.violations += [
            f"step {step}: {v}"
            for v in ownership_violations(
                sched,
                out,
                lookahead=lookahead,
                block_size=wl.block_size,
                max_model_len=wl.max_model_len,
            )
        ]
        check_invariants()

        aborted: Set[str] = set()
        if wl.abort_prob and rng.random() < wl.abort_prob:
            live = sched.running_request_ids() + sched.waiting_request_ids()
            if live:
                victim = rng.choice(live)
                done = sched.finish_requests([victim])
                assert done == [victim]
                tracker.on_finish_requests(done, "abort")
                aborted.add(victim)
        chunks_get_token = rng.random() < 0.2
        sampled = sampled_for(
            out, rng, accept=wl.accept, vocab=VOCAB, token_for_chunks=chunks_get_token
        )
        before = {r: sched.all_token_ids(r) for r in out.req_ids if r not in aborted}
        results = apply_output(
            sched,
            out,
            sampled,
            rng,
            k=wl.k,
            drafts="none" if wl.method is None else "random",
            vocab=VOCAB,
        )
        if chunks_get_token:
            sampled = [[] if c else s for c, s in zip(out.is_prefill_chunk, sampled)]
        tracker.on_update(sched, out, sampled, results, before, aborted)
        check_invariants()
        if not pending and not sched.has_unfinished_requests():
            break

    # Abort whatever is left, flush the finished ids, and check nothing leaked.
    live = sched.running_request_ids() + sched.waiting_request_ids()
    tracker.on_finish_requests(sched.finish_requests(live), "abort")
    out = sched.schedule()
    tracker.on_schedule(out)
    assert list(out.req_ids) == []
    sched.update_from_output(out, ModelRunnerOutput([], []))
    assert tracker.reported_finished == set(keys)
    assert_scheduler_empty(sched, wl.num_blocks)
    report.stats = dict(sched.stats())
    return report


def _settings(max_examples: int, **kwargs: Any) -> Any:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **kwargs,
    )


def _assert_owned(report: Report) -> None:
    assert not report.violations, "\n".join(report.violations[:5])
    assert not report.invariant_errors, "\n".join(report.invariant_errors[:5])


#: Methods each legacy policy is wrong for (for the others it coincides with the correct table).
LEGACY_METHODS = {
    "legacy-first-prefill": LOOKAHEAD_METHODS,
    "legacy-k": ("dflash",),
}


@pytest.mark.parametrize("lookahead_policy", ["correct", "legacy-first-prefill", "legacy-k"])
def test_ownership_property(lookahead_policy: str) -> None:
    """Correct policy: no violation on any workload. Legacy policies: Hypothesis must find a
    workload that violates the contract (both by the test's check and check_invariants)."""
    if lookahead_policy == "correct":
        seen = {"preemptions": 0, "prefix_hits": 0, "drafts": 0, "examples": 0}

        @_settings(400)
        @given(wl=workloads())
        def prop(wl: Workload) -> None:
            report = simulate(wl)
            _assert_owned(report)
            seen["examples"] += 1
            seen["preemptions"] += report.stats["num_preemptions"]
            seen["prefix_hits"] += report.prefix_hit_admissions
            seen["drafts"] += report.stats["spec_num_drafts"]

        prop()
        # The generator really produces the situations the property is about.
        assert all(v > 0 for v in seen.values()), seen
        return

    @_settings(
        60,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        report_multiple_bugs=False,
    )
    @given(wl=workloads(LEGACY_METHODS[lookahead_policy]))
    def legacy_prop(wl: Workload) -> None:
        report = simulate(wl, lookahead_policy)
        if bool(report.violations) != bool(report.invariant_errors):
            # Not an AssertionError: a disagreement between the two checkers must fail the test.
            raise RuntimeError(f"checkers disagree: {report}")
        _assert_owned(report)

    # The test's own checker's message ("step N: ownership: ..."), not check_invariants'.
    with pytest.raises(AssertionError, match=r"step \d+: ownership: "):
        legacy_prop()


@pytest.mark.slow
def test_ownership_property_slow() -> None:
    """The correct-policy property with many more examples. Like every slow test outside
    tests/engine (tests/conftest.py), it only runs when the marker expression asks for it:
    ``pytest tests/scheduler -m slow`` (about a minute)."""

    @_settings(2500)
    @given(wl=workloads())
    def prop(wl: Workload) -> None:
        _assert_owned(simulate(wl))

    prop()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_ownership_property_covers_each_method(method: Optional[str]) -> None:
    """A few examples per method, so each method is exercised whatever the random draw."""

    @_settings(15)
    @given(wl=workloads([method]))
    def prop(wl: Workload) -> None:
        _assert_owned(simulate(wl))

    prop()


# ---------------------------------------------------------------------------------------------
# deterministic workloads built to trigger the legacy bugs


def _decode_run(
    policy: str, method: str, prompt_len: int, *, k: int = 3, steps: int = 24
) -> List[tuple]:
    """One request, one token per step (no drafts); per step: (my violations, rust error)."""
    sched = make_scheduler(64, method=method, k=k, block_size=16, lookahead_policy=policy)
    sched.add_request(Request("r", list(range(prompt_len)), steps + 4))
    rng = random.Random(0)
    lookahead = required_lookahead(method, k)
    per_step = []
    for _ in range(steps):
        out = sched.schedule()
        mine = ownership_violations(
            sched, out, lookahead=lookahead, block_size=16, max_model_len=8192
        )
        try:
            sched.check_invariants()
            rust = None
        except InvariantError as e:
            rust = str(e)
        per_step.append((mine, rust))
        sched.update_from_output(out, _runner(out, sampled_for(out, rng)))
    return per_step


def _runner(out: Any, sampled: List[List[int]]) -> Any:
    return ModelRunnerOutput(out.req_ids, sampled)


@pytest.mark.parametrize("prompt_len", [13, 14, 15, 16])
@pytest.mark.parametrize("policy", ["correct", "legacy-first-prefill", "legacy-k"])
def test_dflash_block_boundary_workload(policy: str, prompt_len: int) -> None:
    """DFlash K=3, block 16: the first prefill's query window is positions P..P+3, so for
    P in 13..16 it reaches block 1. legacy-first-prefill allocates 1 block on admission for all
    four; legacy-k (lookahead 3) misses whenever a step's computed tokens end at 13 mod 16 (the
    4th query slot opens a new block): on admission for P = 13, during decode for the others."""
    per_step = _decode_run(policy, "dflash", prompt_len)
    violating = [i for i, (mine, _) in enumerate(per_step) if mine]
    for i, (mine, rust) in enumerate(per_step):
        assert bool(mine) == (rust is not None), (i, mine, rust)
        if rust is not None:
            assert "ownership" in rust
    if policy == "correct":
        assert violating == []
    elif policy == "legacy-first-prefill":
        assert violating == [0]
    else:
        # Step 0 computes P tokens; step s >= 1 ends at P + s. Violation when end + 3 is a
        # multiple of 16 (the K+1-th query slot starts a new block).
        expected = [s for s in range(len(per_step)) if (prompt_len + s + 3) % 16 == 0]
        assert violating == expected and expected


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "draft_model"])
def test_legacy_policies_for_k_lookahead_methods(method: str) -> None:
    """For K-lookahead drafters, legacy-k is the correct table (no violation), while
    legacy-first-prefill misses the first prefill's lookahead."""
    assert not any(mine for mine, _ in _decode_run("legacy-k", method, 16))
    assert not any(mine for mine, _ in _decode_run("correct", method, 16))
    first = _decode_run("legacy-first-prefill", method, 16)
    assert first[0][0] and first[0][1] is not None
    assert not any(mine for mine, _ in first[1:])


@pytest.mark.parametrize("policy", ["correct", "legacy-first-prefill", "legacy-k"])
def test_prefix_hit_admission_gets_full_lookahead(policy: str) -> None:
    """Prefix-cache admissions get the full lookahead too: "b" shares "a"'s first 32 tokens and
    is 45 long, so its first step computes 13 tokens from position 32 and its query window
    reaches position 48 (block 3); 45 + 3 == 48, so legacy-k misses it as well."""
    k, bs = 3, 16
    sched = make_scheduler(64, method="dflash", k=k, block_size=bs, lookahead_policy=policy)
    a = list(range(100, 148))
    sched.add_request(Request("a", a, 4))
    out = sched.schedule()
    sched.update_from_output(out, _runner(out, [[1]]))
    sched.add_request(Request("b", a[:32] + [7] * 13, 4))
    out = sched.schedule()
    (new,) = out.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens == 32
    assert new.block_ids[:2] == sched.block_ids("a")[:2]
    violations = ownership_violations(
        sched, out, lookahead=k + 1, block_size=bs, max_model_len=8192
    )
    if policy == "correct":
        assert violations == []
        assert len(sched.block_ids("b")) == 4
        sched.check_invariants()
    else:
        assert any("'b'" in v for v in violations), violations
        assert len(sched.block_ids("b")) == 3
        with pytest.raises(InvariantError, match="ownership"):
            sched.check_invariants()


def test_resume_gets_full_lookahead() -> None:
    """A preempted DFlash request is readmitted with K+1 lookahead (correct policy), and gets
    none under legacy-first-prefill."""
    for policy, expect_violation in [("correct", False), ("legacy-first-prefill", True)]:
        # 4 usable blocks of 16. "a": 28 tokens -> 28 + 4 = 32 -> 2 blocks; "b": 13 -> 2 blocks
        # (13 + 4 = 17). After a's first decode token it needs a 3rd block -> b is preempted.
        sched = make_scheduler(
            5, method="dflash", k=3, block_size=16, lookahead_policy=policy, max_model_len=64
        )
        sched.add_request(Request("a", list(range(28)), 20, arrival_time=0.0))
        sched.add_request(Request("b", list(range(200, 213)), 20, arrival_time=1.0))
        rng = random.Random(0)
        saw_resume = False
        for _ in range(12):
            out = sched.schedule()
            v = ownership_violations(sched, out, lookahead=4, block_size=16, max_model_len=64)
            resumed = [r for r in out.scheduled_new_reqs if r.resumed]
            if resumed:
                saw_resume = True
                assert bool(v) == expect_violation, v
            elif policy == "correct":
                assert not v
            sched.update_from_output(out, _runner(out, sampled_for(out, rng)))
            if sched.has_request("a") and len(sched.all_token_ids("a")) >= 30:
                sched.finish_requests(["a"])  # makes room for "b" to resume
        assert saw_resume, policy
        assert sched.stats()["num_preemptions"] >= 1


def test_checker_flags_a_larger_window() -> None:
    """The checker is not vacuous: asking for more lookahead than was allocated fails."""
    sched = make_scheduler(64, method="dflash", k=3, block_size=16)
    sched.add_request(Request("r", list(range(12)), 4))
    out = sched.schedule()
    assert not ownership_violations(sched, out, lookahead=4, block_size=16, max_model_len=8192)
    assert ownership_violations(sched, out, lookahead=5, block_size=16, max_model_len=8192)
    # ... and the max_model_len cap is what makes a full window near the limit legal.
    sched = make_scheduler(64, method="dflash", k=3, block_size=16, max_model_len=16)
    sched.add_request(Request("r", list(range(14)), 1))
    out = sched.schedule()
    assert sched.block_ids("r") and len(sched.block_ids("r")) == 1
    assert not ownership_violations(sched, out, lookahead=4, block_size=16, max_model_len=16)
    assert ownership_violations(sched, out, lookahead=4, block_size=16, max_model_len=32)


class _FakeOut:
    """A copy of a step's arrays that a test can corrupt (the real views are read-only)."""

    def __init__(self, out: Any) -> None:
        self.req_ids = list(out.req_ids)
        self.block_table = np.array(out.block_table, copy=True)
        self.num_blocks_per_row = np.array(out.num_blocks_per_row, copy=True)
        self.num_computed_tokens = np.array(out.num_computed_tokens, copy=True)
        self.num_scheduled_tokens_array = np.array(out.num_scheduled_tokens_array, copy=True)

    def freeze(self) -> _FakeOut:
        self.block_table.setflags(write=False)
        self.num_blocks_per_row.setflags(write=False)
        return self


class _SharingScheduler:
    """Delegates to a scheduler but reports ``extra`` as also held by ``holder``."""

    def __init__(self, sched: Scheduler, holder: str, extra: int) -> None:
        self.sched, self.holder, self.extra = sched, holder, extra

    def running_request_ids(self) -> List[str]:
        return self.sched.running_request_ids()

    def block_ids(self, rid: str) -> List[int]:
        blocks = self.sched.block_ids(rid)
        return [*blocks, self.extra] if rid == self.holder else blocks


def test_checkers_flag_corrupted_tables() -> None:
    """Each branch of the step checks fires on a corrupted copy of a real step."""
    sched = make_scheduler(64, method="dflash", k=3, block_size=4)
    sched.add_request(Request("a", list(range(10)), 8))
    sched.add_request(Request("b", list(range(100, 106)), 8))
    out = sched.schedule()
    kw = {"lookahead": 4, "block_size": 4, "max_model_len": 8192}
    check_block_table(sched, out)
    assert ownership_violations(sched, out, **kw) == []
    row_a = out.req_ids.index("a")
    row_b = 1 - row_a
    count_a = int(out.num_blocks_per_row[row_a])

    swapped = _FakeOut(out)
    swapped.block_table[row_a, 0] = swapped.block_table[row_b, 0]
    assert any("not one of its blocks" in v for v in ownership_violations(sched, swapped, **kw))
    with pytest.raises(AssertionError):
        check_block_table(sched, swapped.freeze())

    null = _FakeOut(out)
    null.block_table[row_a, count_a - 1] = 0
    assert any("holds block 0" in v for v in ownership_violations(sched, null, **kw))

    short = _FakeOut(out)
    short.num_blocks_per_row[row_a] -= 1
    assert any("but its row has" in v for v in ownership_violations(sched, short, **kw))
    with pytest.raises(AssertionError):
        check_block_table(sched, short.freeze())

    stale = _FakeOut(out)
    stale.block_table[row_b, int(out.num_blocks_per_row[row_b])] = 7
    with pytest.raises(AssertionError, match="stale ids"):
        check_block_table(sched, stale.freeze())

    # a's last block covers lookahead positions; if "b" also held it, drafts would collide.
    shared = _SharingScheduler(sched, "b", sched.block_ids("a")[-1])
    assert any("lookahead block" in v for v in ownership_violations(shared, out, **kw))
