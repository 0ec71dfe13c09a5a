"""``DFlashRsScheduler`` behaviour beyond the parity traces: the engine-facing corners."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from vllm.config import SchedulerConfig
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine import EngineCoreEventType, FinishReason
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from dflash_rs.errors import SchedulerStateError
from dflash_rs.vllm import DFlashRsScheduler
from dflash_rs.vllm._compat import installed


def _runner(out: Any, token: int = 40) -> ModelRunnerOutput:
    """Every scheduled request that finished its prefill samples ``token``."""
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
    )


def _step(s: Any, token: int = 40) -> tuple[Any, dict[int, Any]]:
    out = s.schedule()
    return out, s.update_from_output(out, _runner(out, token))


def test_class_path_resolves() -> None:
    config = SchedulerConfig(
        max_model_len=512,
        is_encoder_decoder=False,
        scheduler_cls="dflash_rs.vllm.DFlashRsScheduler",
    )
    assert config.get_scheduler_cls() is DFlashRsScheduler


def test_import_dflash_rs_does_not_import_vllm() -> None:
    code = "import sys, dflash_rs, dflash_rs.vllm; assert 'vllm' not in sys.modules, 'vllm'"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))


def test_request_lifecycle_and_events(scheduler: Any, offline: Any) -> None:
    req = offline.request("a", [20] * 40, 2)
    scheduler.add_request(req)
    assert scheduler.has_request("a") and scheduler.requests["a"] is req
    assert scheduler.get_request_counts() == (0, 1)
    out, outs = _step(scheduler)
    assert req.status == RequestStatus.RUNNING
    (o,) = outs[0].outputs
    assert o.new_token_ids == [40] and o.finish_reason is None
    assert [e.type for e in o.events] == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    assert o.prefill_stats is not None and o.prefill_stats.num_prompt_tokens == 40
    assert outs[0].scheduler_stats.num_running_reqs == 1
    out, outs = _step(scheduler)
    (o,) = outs[0].outputs
    assert o.finish_reason == FinishReason.LENGTH and o.events is None
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not scheduler.has_request("a") and scheduler.has_finished_requests()
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"} and not scheduler.has_requests()


def test_abort_all_returns_requests(scheduler: Any, offline: Any) -> None:
    for i in range(3):
        scheduler.add_request(offline.request(f"r{i}", [20 + i] * 30, 5))
    _step(scheduler)
    done = scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert sorted(r.request_id for r in done) == ["r0", "r1", "r2"]
    assert all(r.status == RequestStatus.FINISHED_ABORTED for r in done)
    assert scheduler.finish_requests("r0", RequestStatus.FINISHED_ABORTED) == []
    assert scheduler.has_finished_requests() and not scheduler.has_unfinished_requests()
    out = scheduler.schedule()
    assert out.finished_req_ids == {"r0", "r1", "r2"} and not out.num_scheduled_tokens
    assert scheduler.update_from_output(out, ModelRunnerOutput([], {}))[0].outputs == []


def test_include_finished_set(make_scheduler: Any, offline: Any) -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    cfg, kv = offline.configs(num_blocks=64)
    s = DFlashRsScheduler(
        vllm_config=cfg,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=16,
        hash_block_size=16,
        include_finished_set=True,
    )
    s.add_request(offline.request("a", [20] * 20, 1))
    s.add_request(offline.request("b", [21] * 20, 5, client_index=1))
    s.add_request(offline.request("c", [22] * 20, 2, client_index=1))
    _, outs = _step(s)
    assert outs[0].finished_requests == {"a"}
    assert sorted(o.request_id for o in outs[1].outputs) == ["b", "c"]
    s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
    _, outs = _step(s)
    assert [(o.request_id, o.finish_reason) for o in outs[1].outputs] == [
        ("c", FinishReason.LENGTH)
    ]
    assert outs[1].finished_requests == {"b", "c"} and outs[1].scheduler_stats is None
    assert 0 not in outs  # log_stats off: no stats to carry, nothing for client 0


def test_pause_states(scheduler: Any, offline: Any) -> None:
    scheduler.add_request(offline.request("a", [20] * 20, 10))
    _step(scheduler)
    scheduler.add_request(offline.request("b", [21] * 20, 10))
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    assert scheduler.pause_state == PauseState.PAUSED_ALL
    assert scheduler.core.pause_state == "paused_all"
    assert scheduler.get_num_unfinished_requests() == 0 and not scheduler.has_requests()
    out, _ = _step(scheduler)
    assert out.total_num_scheduled_tokens == 0 and out.num_scheduled_tokens == {}
    scheduler.set_pause_state(PauseState.PAUSED_NEW)
    assert scheduler.get_num_unfinished_requests() == 1  # running only
    out, _ = _step(scheduler)
    assert set(out.num_scheduled_tokens) == {"a"}  # b is not admitted
    scheduler.set_pause_state(PauseState.UNPAUSED)
    assert scheduler.get_num_unfinished_requests() == 2
    out, _ = _step(scheduler)
    assert set(out.num_scheduled_tokens) == {"a", "b"}


def test_paused_all_still_reports_finished_requests(scheduler: Any, offline: Any) -> None:
    """As vLLM 0.33: an abort under PAUSED_ALL makes has_finished_requests() True, so the
    engine runs a step that schedules nothing and carries the finished id to the workers."""
    scheduler.add_request(offline.request("a", [20] * 20, 10))
    scheduler.add_request(offline.request("b", [21] * 20, 10))
    _step(scheduler)
    scheduler.set_pause_state(PauseState.PAUSED_ALL)
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.has_finished_requests() and scheduler.has_requests()
    out, _ = _step(scheduler)
    assert out.finished_req_ids == {"a"} and out.total_num_scheduled_tokens == 0
    assert not scheduler.has_requests()


def test_output_of_another_step_is_refused(scheduler: Any, offline: Any) -> None:
    scheduler.add_request(offline.request("a", [20] * 20, 10))
    out = scheduler.schedule()
    scheduler.update_from_output(out, _runner(out))
    with pytest.raises(SchedulerStateError):
        scheduler.update_from_output(out, _runner(out))


def test_drafts_reach_the_next_step(make_scheduler: Any, offline: Any) -> None:
    s = make_scheduler(method="dflash", num_speculative_tokens=3)
    s.add_request(offline.request("a", [20] * 20, 50))
    _step(s)
    s.update_draft_token_ids(DraftTokenIds(["a"], [[50, 51, 52]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [50, 51, 52]}
    assert out.num_scheduled_tokens == {"a": 4}
    mro = ModelRunnerOutput(["a"], {"a": 0}, sampled_token_ids=[[50, 51, 60]])
    outs = s.update_from_output(out, mro)
    (o,) = outs[0].outputs
    assert o.new_token_ids == [50, 51, 60]
    spec = outs[0].scheduler_stats.spec_decoding_stats
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (1, 3, 2)
    assert spec.num_accepted_tokens_per_pos == [1, 1, 0]
    assert spec.num_draft_tokens_per_pos == [1, 1, 1]
    assert s.core.num_computed_tokens("a") == 20 + 1 + 2


def test_request_the_pool_can_never_hold(make_scheduler: Any, offline: Any) -> None:
    """Intended difference: vLLM would preempt it forever; dflash-rs ends it with an error."""
    s = make_scheduler(num_blocks=8, max_model_len=512)
    s.add_request(offline.request("big", [20] * 100, 200))
    done: list[Any] = []
    for _ in range(40):
        _, outs = _step(s)
        done = [o for eco in outs.values() for o in eco.outputs if o.finished]
        if done:
            break
    (o,) = done
    assert o.finish_reason == FinishReason.ERROR
    if installed().output_has_error:  # EngineCoreOutput.error is new in vLLM 0.33
        assert "never hold" in o.error.message
    assert not s.has_unfinished_requests()


def test_prompt_larger_than_the_pool_is_refused(make_scheduler: Any, offline: Any) -> None:
    """Intended difference: vLLM would queue it forever (it can never pass admission)."""
    s = make_scheduler(num_blocks=8, max_model_len=512)
    s.add_request(offline.request("huge", [20] * 300, 4))
    s.add_request(offline.request("ok", [21] * 20, 1))
    assert not s.has_request("huge") and s.has_requests()
    _, outs = _step(s)
    by_id = {o.request_id: o for o in outs[0].outputs}
    assert by_id["huge"].finish_reason == FinishReason.ERROR
    assert by_id["ok"].finish_reason == FinishReason.LENGTH


def test_reset_prefix_cache(scheduler: Any, offline: Any) -> None:
    assert scheduler.reset_prefix_cache()
    scheduler.add_request(offline.request("a", [20] * 20, 10))
    scheduler.add_request(offline.request("b", [21] * 20, 10))
    _step(scheduler)
    assert not scheduler.reset_prefix_cache()  # blocks are held
    assert scheduler.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    assert scheduler.get_kv_cache_usage() == 0.0
    assert scheduler.get_request_counts() == (0, 2)
    for rid in "ab":
        req = scheduler.requests[rid]
        assert req.status == RequestStatus.PREEMPTED
        assert (req.num_preemptions, req.num_computed_tokens) == (1, 0)
        assert [e.type for e in req.events][-1] == EngineCoreEventType.PREEMPTED
    assert scheduler.core.waiting_request_ids() == ["a", "b"]
    out, outs = _step(scheduler)
    assert out.preempted_req_ids == {"a", "b"}
    assert outs[0].scheduler_stats.prefix_cache_stats.reset
    for rid in "ab":
        assert scheduler.requests[rid].status == RequestStatus.RUNNING
        assert scheduler.requests[rid].num_preemptions == 1  # counted once
    _, outs = _step(scheduler)
    assert not outs[0].scheduler_stats.prefix_cache_stats.reset
    scheduler.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.reset_prefix_cache()
    scheduler.reset_encoder_cache()
    assert scheduler.get_kv_cache_usage() == 0.0


def test_reset_with_a_step_in_flight_drops_its_output(make_scheduler: Any, offline: Any) -> None:
    """Async scheduling: the output of a step scheduled before the reset yields nothing for
    the preempted requests (vLLM's drop_stale_output), which resume at once."""
    s = make_scheduler(method="dflash", num_speculative_tokens=3, async_scheduling=True)
    s.add_request(offline.request("a", [20] * 20, 50))
    first = s.schedule()
    s.update_from_output(first, _runner(first))
    pending = s.schedule()
    s.core.check_invariants()
    assert s.reset_prefix_cache(reset_running_requests=True)
    resumed = s.schedule()
    assert resumed.preempted_req_ids == {"a"}
    if s.vllm_config.use_v2_model_runner:
        assert [r.req_id for r in resumed.scheduled_new_reqs] == ["a"]
    else:  # the V1 runner gets a resumed request as a cached one with all its tokens
        assert set(resumed.scheduled_cached_reqs.resumed_req_ids) == {"a"}
    mro = ModelRunnerOutput(["a"], {"a": 0}, sampled_token_ids=[[41, 42]])
    outs = s.update_from_output(pending, mro)
    assert not any(eco.outputs for eco in outs.values())
    assert outs[0].scheduler_stats.spec_decoding_stats is None  # no draft was verified
    s.core.check_invariants()
    outs = s.update_from_output(resumed, _runner(resumed, 43))
    assert [o.new_token_ids for o in outs[0].outputs] == [[43]]
    assert s.core.all_token_ids("a") == [20] * 20 + [40, 43]


@pytest.mark.parametrize(
    ("method", "speculative", "caching", "lookahead_033", "drop_033", "drop_032"),
    [
        # vLLM's defaults: 0.33 hashes each block with the next token, 0.32 drops the last hit.
        ("eagle", {}, True, 1, False, True),
        ("eagle3", {}, True, 1, False, True),
        ("eagle", {"disable_lookahead_block_hashes": True}, True, 0, True, True),
        ("eagle", {"disable_eagle_block_drop": True}, True, 0, False, False),
        ("eagle", {}, False, 0, True, True),  # no prefix caching: no lookahead hashes
        ("dflash", {}, True, 0, False, True),  # 0.33 no longer drops for DFlash
        ("none", {}, True, 0, False, False),
    ],
)
def test_prefix_cache_rules_of_eagle_style_drafters(
    offline: Any,
    method: str,
    speculative: dict[str, Any],
    caching: bool,
    lookahead_033: int,
    drop_033: bool,
    drop_032: bool,
) -> None:
    """The core gets vLLM's rule for reusing a drafter's KV on a prefix hit: lookahead hashes
    (``hash_lookahead_tokens``), the last-block drop, or neither, exactly where the installed
    vLLM uses them."""
    from dflash_rs.vllm._config import translate_config

    on_033 = installed().has_hash_lookahead_tokens
    if "disable_lookahead_block_hashes" in speculative and not on_033:
        pytest.skip("vLLM 0.32 has no lookahead block hashes to disable")
    cfg, kv = offline.configs(
        num_blocks=64,
        method=method,
        enable_prefix_caching=caching,
        speculative=speculative or None,
    )
    config = translate_config(cfg, kv, 16, 16).config
    assert config.hash_lookahead_tokens == (lookahead_033 if on_033 else 0)
    assert config.drop_last_hit_block == (drop_033 if on_033 else drop_032)
    if on_033:
        assert config.hash_lookahead_tokens == cfg.num_hash_lookahead_tokens
