"""Corners of ``reset_prefix_cache(reset_running_requests=True)`` and the pause states that the
seeded parity traces (``test_parity.py``, the ``reset``/``new``/``all`` cases) rarely reach,
each as a few deterministic calls on vLLM 0.33's ``AsyncScheduler`` and on
``DFlashRsScheduler``, compared after every call.
"""

from __future__ import annotations

from typing import Any

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import TraceParams, _norm_engine, compare_outputs, use_v1_runner
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from dflash_rs.vllm import DFlashRsScheduler


@pytest.fixture
def pair(offline: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``pair(**configs)``: [(vLLM's AsyncScheduler, hasher), (ours, None)] on one config."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0" if use_v1_runner(False) else "1")

    def make(**kwargs: Any) -> list[tuple[Any, Any]]:
        cfg, kv = offline.configs(async_scheduling=True, **kwargs)
        return [
            (offline.scheduler(AsyncScheduler, cfg, kv), offline.block_hasher(cfg)),
            (offline.scheduler(DFlashRsScheduler, cfg, kv), None),
        ]

    return make


def _state(s: Any) -> Any:
    core = s.core if isinstance(s, DFlashRsScheduler) else None
    state = {}
    for rid, r in sorted(s.requests.items()):
        computed = core.num_computed_tokens(rid) if core else r.num_computed_tokens
        tokens = core.all_token_ids(rid) if core else list(r.all_token_ids)
        placeholders = core.num_output_placeholders(rid) if core else r.num_output_placeholders
        state[rid] = (str(r.status), r.num_preemptions, computed, placeholders, tokens)
    return (s.get_request_counts(), s.has_requests(), round(s.get_kv_cache_usage(), 9), state)


def _same_state(v: Any, d: Any, when: str) -> None:
    assert _state(d) == _state(v), when
    d.core.check_invariants()


def _runner(out: Any, sampled: dict[str, list[int]]) -> ModelRunnerOutput:
    ids = sorted(out.num_scheduled_tokens)
    return ModelRunnerOutput(ids, {r: i for i, r in enumerate(ids)}, [sampled[r] for r in ids])


def test_preemption_while_dropped_output_is_in_flight_drops_the_later_output_too(
    pair: Any, offline: Any
) -> None:
    """Three steps in flight (V2 runner, two pipeline stages). s0 prefills a and b; the reset
    preempts both (s0's output is to be dropped); s1 resumes both; s2 needs a fifth block for a
    and preempts b in the ordinary way while s0 is still in flight. vLLM keeps b's
    ``drop_stale_output`` then (its dropped share is undrained), so b's s1 output is dropped as
    well instead of being delivered."""
    v, d = pair(
        num_blocks=9, method="dflash", num_speculative_tokens=3, max_model_len=256
    )  # 8 usable blocks; a 60-token prompt + K + 1 lookahead fills 4
    p = TraceParams(seed=0, method="dflash", async_scheduling=True)
    (vs, hasher), (ds, _) = v, d
    for rid, base in (("a", 1000), ("b", 2000)):
        vs.add_request(offline.request(rid, list(range(base, base + 60)), 50, hasher))
        ds.add_request(offline.request(rid, list(range(base, base + 60)), 50))
    steps = []
    for i, event in enumerate(["schedule", "reset", "schedule", "schedule"]):
        if event == "reset":
            assert vs.reset_prefix_cache(reset_running_requests=True)
            assert ds.reset_prefix_cache(reset_running_requests=True)
        else:
            sv, sd = vs.schedule(), ds.schedule()
            compare_outputs(p, i, sv, sd)
            steps.append((sv, sd))
        _same_state(vs, ds, f"after {event} {i}")
    assert steps[2][0].preempted_req_ids == {"b"}
    b = vs.requests["b"]
    assert b.drop_stale_output and b.num_stale_output_tokens == 120  # s0 and s1
    for i, (sv, sd) in enumerate(steps):
        sampled = {rid: [40 + i] for rid in sv.num_scheduled_tokens}
        ov = vs.update_from_output(sv, _runner(sv, sampled))
        od = ds.update_from_output(sd, _runner(sd, sampled))
        assert _norm_engine(od) == _norm_engine(ov), i
        _same_state(vs, ds, f"after output {i}")
    # b got no token from s0 nor s1; a only from s1 and s2 (s0's was dropped).
    assert ds.core.all_token_ids("b") == list(range(2000, 2060))
    assert ds.core.all_token_ids("a")[60:] == [41, 42]
    assert ds.requests["b"].status == RequestStatus.PREEMPTED


def test_pause_keep_with_a_reset_then_resume(pair: Any, offline: Any) -> None:
    """vLLM's ``pause_generation(mode="keep", clear_cache=True)``: PAUSED_ALL, then
    reset_prefix_cache(reset_running_requests=True, reset_connector=True) with a step in
    flight. The pause step reports the preempted ids; the output in flight is dropped;
    resuming recomputes the requests from an empty cache."""
    v, d = pair(
        num_blocks=48,
        method="eagle",
        num_speculative_tokens=2,
        speculative={"disable_eagle_block_drop": True},
    )
    p = TraceParams(seed=0, method="eagle", async_scheduling=True)
    (vs, hasher), (ds, _) = v, d
    for rid, base in (("a", 1000), ("b", 2000), ("c", 3000)):
        vs.add_request(offline.request(rid, list(range(base, base + 40)), 50, hasher))
        ds.add_request(offline.request(rid, list(range(base, base + 40)), 50))
    pending = [(vs.schedule(), ds.schedule())]
    compare_outputs(p, 0, *pending[0])
    for s in (vs, ds):
        s.set_pause_state(PauseState.PAUSED_ALL)
        assert s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
        s.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    _same_state(vs, ds, "after pause and reset")
    assert vs.has_finished_requests() and ds.has_finished_requests()
    paused = (vs.schedule(), ds.schedule())
    compare_outputs(p, 1, *paused)
    assert paused[0].preempted_req_ids == {"a", "b", "c"}
    assert paused[0].finished_req_ids == {"c"}
    assert paused[0].total_num_scheduled_tokens == 0
    for i, (sv, sd) in enumerate([pending[0], paused]):
        sampled = {rid: [50] for rid in sv.num_scheduled_tokens}
        ov = vs.update_from_output(sv, _runner(sv, sampled))
        od = ds.update_from_output(sd, _runner(sd, sampled))
        assert _norm_engine(od) == _norm_engine(ov) == {}, i
        _same_state(vs, ds, f"after output {i}")
    assert not vs.has_requests() and not ds.has_requests()
    for s in (vs, ds):
        s.set_pause_state(PauseState.UNPAUSED)
    sv, sd = vs.schedule(), ds.schedule()
    compare_outputs(p, 2, sv, sd)
    assert sv.num_scheduled_tokens == {"a": 40, "b": 40}
    assert all(r.num_computed_tokens == 0 for r in sv.scheduled_new_reqs)
    _same_state(vs, ds, "after resume")
