"""Parity of the prefill cadence: vLLM's own ``Scheduler`` (``AsyncScheduler`` under async
scheduling) and ``DFlashRsScheduler`` on the same traces (``parity.Lockstep``), with
``prefill_schedule_interval`` 1 to 4, data-parallel sizes 1 and 2, and ``throttle_prefills``
passed as vLLM's DP engine core passes it (on every step off a multiple of the interval) or at
random; identical step by step.

vLLM 0.33 applies the interval locally when ``data_parallel_size`` is 1 (a DP engine core
throttles instead, through ``throttle_prefills``); vLLM 0.32 only has the throttle, so there
the interval alone changes nothing, on both sides.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import Lockstep, TraceParams

from dflash_rs.vllm._compat import installed


class Case(NamedTuple):
    interval: int
    dp: int = 1
    #: "none", "engine" (the DP engine core's: every step off a multiple of the interval) or
    #: "random" (half the steps).
    throttle: str = "none"
    method: str = "none"
    k: int = 3
    in_flight: int = 0
    seed: int = 0
    policy: str = "fcfs"

    @property
    def id(self) -> str:
        mode = f"-async{self.in_flight}" if self.in_flight else ""
        k = f"-K{self.k}" if self.method != "none" else ""
        return (
            f"interval{self.interval}-dp{self.dp}-throttle-{self.throttle}-{self.method}{k}"
            f"-{self.policy}{mode}-seed{self.seed}"
        )


def _params(case: Case) -> TraceParams:
    extra: dict[str, Any] = {"scheduler": {"prefill_schedule_interval": case.interval}}
    if case.dp > 1:
        extra["parallel"] = {"data_parallel_size": case.dp}
    kw: dict[str, Any] = {}
    if case.throttle == "engine":
        kw["throttle_every"] = case.interval
    elif case.throttle == "random":
        kw["throttle_prob"] = 0.5
    if case.in_flight:
        kw.update(async_scheduling=True, batch_queue_size=case.in_flight)
    return TraceParams(
        seed=case.seed,
        method=case.method,
        k=case.k,
        policy=case.policy,
        extra=extra,
        **kw,
    )


_CASES: list[Case] = [
    # The local cadence (0.33), without DP and with DP (where only the throttle acts).
    *(Case(i, dp, seed=s) for i in (1, 2, 3, 4) for dp in (1, 2) for s in range(2)),
    # The DP engine core's throttle, and a random one, with and without the local interval.
    *(Case(i, 2, "engine", seed=s) for i in (2, 3, 4) for s in range(2)),
    *(Case(i, 1, "engine", seed=s) for i in (2, 4) for s in range(2)),
    *(Case(i, dp, "random", seed=s) for i in (1, 3) for dp in (1, 2) for s in range(2)),
    # Speculative decoding (padded admissions, prefix hits with one token left), priority.
    *(Case(i, 1, t, "dflash", seed=s) for i, t in ((3, "none"), (2, "random")) for s in range(2)),
    *(Case(3, 2, "engine", "eagle", seed=s) for s in range(2)),
    *(Case(i, 1, "none", "ngram", seed=s) for i in (2, 4) for s in range(2)),
    *(Case(3, dp, "random", policy="priority", seed=s) for dp in (1, 2) for s in range(2)),
    # Async scheduling: steps in flight while prefills wait.
    *(Case(i, 1, "none", in_flight=2, seed=s) for i in (2, 4) for s in range(2)),
    *(Case(3, 2, "engine", "dflash", in_flight=2, seed=s) for s in range(2)),
    *(Case(2, 1, "random", "dflash", in_flight=2, seed=s) for s in range(2)),
    *(Case(4, 1, "none", "eagle", in_flight=3, seed=s) for s in range(2)),
]


def _param(case: Case) -> Any:
    if case.method == "ngram" and case.in_flight and installed().name == "0.32":
        reason = "vLLM 0.32 refuses async scheduling with the CPU n-gram drafter"
        return pytest.param(case, id=case.id, marks=(pytest.mark.skip(reason=reason),))
    return pytest.param(case, id=case.id)


@pytest.mark.parametrize("case", [_param(c) for c in _CASES])
def test_parity_cadence(offline: Any, case: Case) -> None:
    res = Lockstep(offline, _params(case)).run()
    assert res.finished > 0
    if case.throttle != "none":
        assert res.throttled_steps > 0


def test_the_drop_in_takes_vllms_local_interval(offline: Any) -> None:
    """The interval the core applies is vLLM's own ``local_prefill_interval`` where the series
    has one (1 under DP), and 1 on 0.32."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from dflash_rs.vllm import DFlashRsScheduler

    for interval in (1, 3):
        for dp in (1, 2):
            cfg, kv = offline.configs(
                num_blocks=48,
                max_model_len=256,
                scheduler={"prefill_schedule_interval": interval},
                parallel={"data_parallel_size": dp},
            )
            ours = offline.scheduler(DFlashRsScheduler, cfg, kv).core_config
            vllm = offline.scheduler(Scheduler, cfg, kv)
            expected = getattr(vllm, "local_prefill_interval", 1)
            assert ours.local_prefill_interval == expected
            local = installed().has_local_prefill_cadence and dp == 1
            assert expected == (interval if local else 1)


def test_the_cadence_changes_the_traces(offline: Any) -> None:
    """Premise: the cadence really changes what is scheduled (the same seed without it gives
    other steps), so the parity cases are not vacuous; on 0.32 the interval alone does not."""

    def digest(case: Case) -> str:
        return Lockstep(offline, _params(case)).run().schedule_digest

    baseline = digest(Case(1, seed=0))
    assert digest(Case(1, 2, seed=0)) == baseline  # DP alone changes nothing
    assert digest(Case(3, 2, "engine", seed=0)) != baseline
    assert digest(Case(2, 1, "engine", seed=0)) != baseline
    local = digest(Case(3, seed=0))
    assert (local != baseline) == installed().has_local_prefill_cadence
    assert digest(Case(3, 2, seed=0)) == baseline  # under DP the interval is the engine's
