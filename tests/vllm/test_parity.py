"""Parity: vLLM's own ``Scheduler`` (0.32 and 0.33) and ``DFlashRsScheduler``, step by step;
and, with async scheduling, vLLM's ``AsyncScheduler`` and ``DFlashRsScheduler`` driven by the
engine's async loop (step N+1 scheduled before step N's output is applied).

Each case drives both schedulers through one seeded trace (``parity.Lockstep``): shared-prefix
prompts, a pool small enough to preempt, chunked prefill, random acceptance of random drafts,
EOS/stop tokens, random aborts. After every call it compares the scheduled requests and token
counts, spec tokens, new/cached request data (block ids included), preempted and finished ids,
the EngineCoreOutputs (tokens, finish and stop reasons), SchedulerStats (prefix-cache counters of
first admissions and of re-admissions included) and the per-request
state (including ``num_output_placeholders``). The first difference fails the case with its
seed, step and field.

Adaptations for intended differences (docs/ARCHITECTURE.md, "vLLM drop-in"):

- EAGLE and EAGLE3 run with vLLM's defaults (on 0.33, lookahead block hashes: each block hashed
  with the token after it; on 0.32, the last hit block dropped), and EAGLE also with
  ``disable_eagle_block_drop=True`` ("eagle-nodrop"). Cases with a 32-token shared prefix
  ("-prefix32") make prompts diverge right after a block boundary, where a lookahead hash and a
  plain one give different hits.
- Prompts never reach ``max_model_len`` and the pool always holds the longest request, so the
  two intended differences in those corners (prefill at the context limit, a request the pool
  can never hold) do not arise; arrival times are distinct, so priority ties do not either.
- Order inside dicts and lists is not compared where vLLM's consumers key by request id:
  dflash-rs lays the batch out in its persistent block-table row order.
- The fabricated sampler behaves like a real one: no stop token below ``min_tokens``, and the
  ``-1`` placeholder drafts vLLM pads some admissions with are never accepted.

Divergences of the Rust core found by these traces (``parity.KNOWN_DIVERGENCES``) are all
fixed; ``test_divergences.py`` keeps a minimal repro of each as a regression test. A new one
goes into ``KNOWN_DIVERGENCES`` and ``DIVERGING`` (a strict xfail at its step), with an
``emulate`` switch in ``parity.Lockstep`` that neutralises it on the vLLM side.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import Divergence, Lockstep, TraceParams

from dflash_rs.vllm._compat import installed

#: The drafter each method name runs, and the speculative-config keys it adds to vLLM's
#: defaults.
_DRAFTERS: dict[str, tuple[str, dict[str, Any]]] = {
    "eagle-nodrop": ("eagle", {"speculative": {"disable_eagle_block_drop": True}}),
}


class Case(NamedTuple):
    method: str
    k: int
    policy: str = "fcfs"
    v1_runner: bool = False
    seed: int = 0
    #: max_num_batched_tokens (None: the trace default, 96 for K = 8). At 64 with K = 8, vLLM
    #: lowers max_num_active_seqs to 64 // 9 = 7 for the DFlash draft pass.
    budget: Optional[int] = None
    #: Steps in flight under async scheduling (0: synchronous). 2 is vLLM's async engine; 3 is
    #: what the V2 model runner keeps in flight with two pipeline stages (stale outputs of
    #: preempted requests then arrive after a later schedule()).
    in_flight: int = 0
    #: Pool size (None: the trace default, 48 blocks of 16).
    num_blocks: Optional[int] = None
    #: "+"-joined engine calls between steps at seeded steps: "reset" (reset_prefix_cache,
    #: mostly with reset_running_requests=True), "new" / "all" (toggle PAUSED_NEW / PAUSED_ALL).
    events: str = ""
    #: Tokens of the prompts' shared prefix (None: the trace default, 40).
    prefix_len: Optional[int] = None

    @property
    def id(self) -> str:
        k = f"-K{self.k}" if self.k else ""
        budget = f"-budget{self.budget}" if self.budget else ""
        v1 = "-v1" if self.v1_runner else ""
        mode = f"-async{self.in_flight}" if self.in_flight else ""
        pool = f"-pool{self.num_blocks}" if self.num_blocks else ""
        events = f"-{self.events}" if self.events else ""
        prefix = f"-prefix{self.prefix_len}" if self.prefix_len else ""
        return (
            f"{self.method}{k}-{self.policy}{v1}{mode}{budget}{pool}{events}{prefix}"
            f"-seed{self.seed}"
        )


_SMALL_POOL = (("none", 0), ("ngram", 3), ("dflash", 3))
_METHODS = (("none", 0), ("ngram", 3), ("eagle", 3), ("dflash", 3))

_CASES: list[Case] = [
    *(Case("none", 0, seed=s) for s in range(6)),
    *(Case("ngram", 3, seed=s) for s in range(6)),
    *(Case("eagle", 3, seed=s) for s in range(6)),
    *(Case("eagle", 3, seed=s, prefix_len=32) for s in range(4)),
    *(Case("eagle3", 3, seed=s, prefix_len=32) for s in range(2)),
    *(Case("eagle-nodrop", 3, seed=s) for s in range(4)),
    *(Case("dflash", 3, seed=s) for s in range(6)),
    *(Case("dflash", 8, seed=s) for s in range(4)),
    *(Case("dflash", 8, seed=s, budget=64) for s in range(2)),
    *(Case("none", 0, "priority", seed=s) for s in range(3)),
    *(Case("dflash", 3, "priority", seed=s) for s in range(3)),
    *(Case("none", 0, v1_runner=True, seed=s) for s in range(3)),
    *(Case("dflash", 3, v1_runner=True, seed=s) for s in range(3)),
]

#: Async scheduling (vLLM's AsyncScheduler): every method, both policies and runners, a pool
#: small enough to preempt often, and three steps in flight.
_ASYNC_CASES: list[Case] = [
    *(Case("none", 0, seed=s, in_flight=2) for s in range(3)),
    *(Case("ngram", 3, seed=s, in_flight=2) for s in range(3)),
    *(Case("eagle", 3, seed=s, in_flight=2) for s in range(3)),
    *(Case("eagle", 3, seed=s, in_flight=2, prefix_len=32) for s in range(2)),
    *(Case("eagle-nodrop", 3, seed=s, in_flight=2) for s in range(2)),
    *(Case("dflash", 3, seed=s, in_flight=2) for s in range(4)),
    *(Case("dflash", 8, seed=s, in_flight=2) for s in range(2)),
    Case("dflash", 8, seed=0, budget=64, in_flight=2),
    *(Case("none", 0, "priority", seed=s, in_flight=2) for s in range(2)),
    *(Case("dflash", 3, "priority", seed=s, in_flight=2) for s in range(2)),
    *(Case("none", 0, v1_runner=True, seed=s, in_flight=2) for s in range(2)),
    *(Case("dflash", 3, v1_runner=True, seed=s, in_flight=2) for s in range(2)),
    *(Case(m, k, seed=s, in_flight=2, num_blocks=24) for m, k in _SMALL_POOL for s in range(2)),
    *(Case(m, k, seed=s, in_flight=3) for m, k in (("none", 0), ("eagle", 3)) for s in range(2)),
    *(Case("dflash", 3, seed=s, in_flight=3) for s in range(3)),
    Case("dflash", 3, "priority", seed=0, in_flight=3, num_blocks=24),
]

#: Resets with running requests and pause states at seeded steps, between engine steps (so, under
#: async scheduling, with two or three steps in flight whose outputs the reset drops).
_EVENT_CASES: list[Case] = [
    *(Case(m, k, seed=s, events="reset+new") for m, k in _METHODS for s in range(2)),
    *(Case(m, k, seed=2, events="reset+all") for m, k in (("none", 0), ("dflash", 3))),
    Case("dflash", 3, "priority", seed=0, events="reset+new"),
    Case("dflash", 3, v1_runner=True, seed=0, events="reset+new+all"),
    *(Case(m, k, seed=s, in_flight=2, events="reset+new") for m, k in _METHODS for s in range(2)),
    *(Case(m, k, seed=2, in_flight=2, events="reset+all") for m, k in (("none", 0), ("dflash", 3))),
    Case("dflash", 3, "priority", seed=0, in_flight=2, events="reset+new"),
    Case("dflash", 3, v1_runner=True, seed=0, in_flight=2, events="reset+new+all"),
    Case("dflash", 8, seed=0, in_flight=2, events="reset+new"),
    *(Case(m, k, seed=0, in_flight=2, num_blocks=24, events="reset+new") for m, k in _SMALL_POOL),
    *(Case("dflash", 3, seed=s, in_flight=3, events="reset+new+all") for s in range(2)),
    Case("none", 0, seed=0, in_flight=3, events="reset"),
    # Pauses alone, and resets alone.
    *(
        Case(m, k, seed=4, events=e)
        for m, k in (("none", 0), ("dflash", 3))
        for e in ("new", "all")
    ),
    *(Case(m, k, seed=4, in_flight=2, events=e) for m, k in _SMALL_POOL for e in ("new", "all")),
    *(Case(m, k, seed=4, in_flight=i, events="reset") for m, k in (("eagle", 3),) for i in (0, 2)),
    Case("eagle", 3, seed=1, in_flight=2, events="reset+new", prefix_len=32),
    Case("eagle-nodrop", 3, seed=0, in_flight=2, events="reset+new"),
]

#: Cases that diverge today: first diverging step and field, and the known divergences that
#: explain them. Empty since the core fixed "cache-at-update", "free-order", "pad-admission" and
#: "stop-trim" (21 cases diverged before).
DIVERGING: dict[Case, tuple[int, str, tuple[str, ...]]] = {}


def _params(case: Case, emulate: tuple[str, ...] = ()) -> TraceParams:
    method, vllm_extra = _DRAFTERS.get(case.method, (case.method, {}))
    extra: dict[str, Any] = {"extra": vllm_extra} if vllm_extra else {}
    if case.prefix_len:
        extra["prefix_len"] = case.prefix_len
    budget = case.budget or (96 if case.k == 8 else None)
    if budget:
        extra["max_num_batched_tokens"] = budget
    if case.num_blocks:
        extra["num_blocks"] = case.num_blocks
    if case.in_flight:
        extra.update(async_scheduling=True, batch_queue_size=case.in_flight)
        extra["rewrite_drafts_prob"] = 0.2
    events = set(case.events.split("+")) - {""}
    if "reset" in events:
        extra["reset_prob"] = 0.04
    pauses = tuple(
        name for e, name in (("new", "PAUSED_NEW"), ("all", "PAUSED_ALL")) if e in events
    )
    if pauses:
        extra.update(pause_prob=0.06, pause_states=pauses)
    return TraceParams(
        seed=case.seed,
        method=method,
        k=case.k or 3,
        policy=case.policy,
        v1_runner=case.v1_runner,
        emulate=emulate,
        **extra,
    )


def _with_marks(case: Case) -> Any:
    if case.method == "ngram" and case.in_flight and installed().name == "0.32":
        reason = "vLLM 0.32 refuses async scheduling with the CPU n-gram drafter"
        return pytest.param(case, id=case.id, marks=(pytest.mark.skip(reason=reason),))
    hit = DIVERGING.get(case)
    if hit is None:
        return pytest.param(case, id=case.id)
    step, where, causes = hit
    reason = f"known dflash-rs divergence {', '.join(causes)} at step {step} ({where})"
    mark = pytest.mark.xfail(strict=True, raises=Divergence, reason=reason)
    return pytest.param(case, id=case.id, marks=(mark,))


@pytest.mark.parametrize("case", [_with_marks(c) for c in _CASES + _ASYNC_CASES + _EVENT_CASES])
def test_parity(offline: Any, case: Case) -> None:
    try:
        res = Lockstep(offline, _params(case)).run()
    except Divergence as e:
        hit = DIVERGING.get(case)
        if hit is not None and f" step={hit[0]}:" not in str(e):
            # Diverges, but not where the known divergence does: something new.
            raise AssertionError(f"diverged elsewhere than recorded ({hit}): {e}") from e
        raise
    assert res.finished > 0


def test_traces_exercise_the_hard_paths(offline: Any) -> None:
    """The trace shape really does preempt, resume, hit the prefix cache, chunk prefills and
    verify drafts (so a passing parity case is not vacuous)."""
    totals = {"preemptions": 0, "resumed": 0, "prefix_hit_admissions": 0, "spec_steps": 0}
    for seed in (1, 3, 5):
        res = Lockstep(offline, _params(Case("dflash", 3, seed=seed))).run()
        for key in totals:
            totals[key] += getattr(res, key)
        assert res.finished > 0 and res.max_running > 1
    assert all(v > 0 for v in totals.values()), totals


def test_async_traces_exercise_the_hard_paths(offline: Any) -> None:
    """Under async scheduling the traces keep two or three steps in flight with placeholders,
    preempt requests whose output is in flight (stale outputs), and rewrite placeholder drafts."""
    totals = {"preemptions": 0, "resumed": 0, "stale_outputs": 0, "draft_rewrites": 0}
    for in_flight in (2, 3):
        res = Lockstep(offline, _params(Case("dflash", 3, seed=1, in_flight=in_flight))).run()
        for key in totals:
            totals[key] += getattr(res, key)
        # Two steps in flight of 1 + K placeholders each (three with a queue of three).
        assert res.max_placeholders == in_flight * (1 + 3)
        assert res.finished > 0 and res.max_running > 1
    assert all(v > 0 for v in totals.values()), totals


def test_reset_and_pause_traces_exercise_the_hard_paths(offline: Any) -> None:
    """The event traces reset with running requests (under async scheduling with steps in
    flight, whose outputs vLLM then drops), hold waiting requests back under PAUSED_NEW, and run
    steps under PAUSED_ALL; the requests still finish."""
    totals = {
        "resets": 0,
        "reset_preempted": 0,
        "dropped_outputs": 0,
        "held_back_steps": 0,
        "paused_all_steps": 0,
        "resumed": 0,
    }
    for case in (
        Case("dflash", 3, seed=0, events="reset+new"),
        Case("dflash", 3, seed=0, in_flight=2, events="reset+new+all"),
        Case("dflash", 3, seed=1, in_flight=3, events="reset+new+all"),
    ):
        res = Lockstep(offline, _params(case)).run()
        assert res.finished > 0 and res.resets > 0 and res.pause_changes > 0, (case, res)
        for key in totals:
            totals[key] += getattr(res, key)
    assert all(v > 0 for v in totals.values()), totals
