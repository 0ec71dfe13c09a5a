"""The vLLM objects ``DFlashRsScheduler`` builds in Rust (``_VllmBridge``): what it reuses from
one step to the next, or from the runner, never lets a caller's change leak into another
step, and what it hands on is what the core scheduled."""

from __future__ import annotations

import gc
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput

from dflash_rs.errors import ArgumentTypeError, InvalidArgumentError

K = 3


def _decode_scheduler(make_scheduler: Any, offline: Any, n: int = 3) -> Any:
    """A DFlash K=3 scheduler with ``n`` requests past their prefill (one step done)."""
    s = make_scheduler(method="dflash", num_speculative_tokens=K, num_blocks=128)
    for i in range(n):
        s.add_request(offline.request(f"r{i}", [20 + i] * 20, 60))
    out = s.schedule()
    s.update_from_output(out, _sampled(out, lambda rid: [40]))
    return s


def _sampled(out: Any, tokens: Any) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[tokens(r) for r in ids],
    )


def _step_with_drafts(s: Any, drafts: dict[str, list[int]]) -> Any:
    """Installs ``drafts`` (in the last step's order), schedules, applies a bonus token only."""
    s.update_draft_token_ids(DraftTokenIds(list(drafts), list(drafts.values())))
    out = s.schedule()
    s.update_from_output(out, _sampled(out, lambda rid: [41]))
    return out


def test_a_held_step_keeps_its_dicts_when_the_next_one_is_the_same(
    make_scheduler: Any, offline: Any
) -> None:
    """Steady decode steps share the batch: from the third such step on, the dict is a copy of
    a private one, so changing what a caller holds changes no other step."""
    s = _decode_scheduler(make_scheduler, offline)
    ids = ["r0", "r1", "r2"]
    steady = {r: K + 1 for r in ids}
    held = []
    for step in range(4):
        out = _step_with_drafts(s, {r: [50 + step, 51, 52] for r in ids})
        assert out.num_scheduled_tokens == steady, step
        assert out.scheduled_cached_reqs.req_ids == ids, step
        assert all(out.num_scheduled_tokens is not h.num_scheduled_tokens for h in held)
        out.num_scheduled_tokens["intruder"] = 99  # the caller's own dict
        out.num_scheduled_tokens["r0"] = 0
        out.scheduled_cached_reqs.req_ids.append("intruder")
        held.append(out)
    s.update_draft_token_ids(DraftTokenIds(ids, [[60, 61, 62]] * 3))
    assert s.schedule().num_scheduled_tokens == steady


def test_the_runner_draft_list_is_handed_on_only_while_the_core_holds_it(
    make_scheduler: Any, offline: Any
) -> None:
    s = _decode_scheduler(make_scheduler, offline, n=2)
    mine = [50, 51, 52]
    s.update_draft_token_ids(DraftTokenIds(["r0", "r1"], [mine, [60, 61, 62]]))
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["r0"] is mine  # as vLLM's scheduler does
    assert out.num_scheduled_tokens == {"r0": K + 1, "r1": K + 1}
    s.update_from_output(out, _sampled(out, lambda rid: [41]))
    # A list the runner shortened after handing it in is not handed on at its new length:
    # the step schedules the drafts the core took, as the core's own list.
    cut = [70, 71, 72]
    s.update_draft_token_ids(DraftTokenIds(["r0", "r1"], [cut, [80, 81, 82]]))
    del cut[1:]
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens["r0"] == [70, 71, 72]
    assert out.scheduled_spec_decode_tokens["r0"] is not cut
    assert out.num_scheduled_tokens["r0"] == K + 1


def test_drafts_of_a_request_the_core_ignored_are_not_handed_on(
    make_scheduler: Any, offline: Any
) -> None:
    """Drafts for a request still in its prefill are ignored by the core; the list must not
    show up as that request's scheduled drafts later."""
    s = make_scheduler(
        method="dflash",
        num_speculative_tokens=K,
        num_blocks=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    s.add_request(offline.request("long", [30] * 100, 20))
    out = s.schedule()  # a chunk of the prefill
    s.update_from_output(out, _sampled(out, lambda rid: []))
    s.update_draft_token_ids(DraftTokenIds(["long"], [[90, 91, 92]]))
    while True:
        out = s.schedule()
        assert "long" not in out.scheduled_spec_decode_tokens
        done = s.core.num_computed_tokens("long") >= 100
        sampled = [42] if done else []
        s.update_from_output(out, _sampled(out, lambda rid, sampled=sampled: sampled))
        if done:
            break


def test_runner_output_in_another_order_and_bad_tokens(make_scheduler: Any, offline: Any) -> None:
    s = _decode_scheduler(make_scheduler, offline)
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)[::-1]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[43 + i] for i in range(len(ids))],
    )
    outs = s.update_from_output(out, mro)
    got = {o.request_id: o.new_token_ids for o in outs[0].outputs}
    assert got == {r: [43 + i] for i, r in enumerate(ids)}
    out = s.schedule()
    bad = _sampled(out, lambda rid: ["x"])
    with pytest.raises(InvalidArgumentError, match=r"sampled_token_ids\[0\]"):
        s.update_from_output(out, bad)
    s.core.check_invariants()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_a_refused_runner_output_leaves_the_step_awaiting_its_output(
    make_scheduler: Any, offline: Any, in_flight: int
) -> None:
    """A runner output refused for bad input changes nothing: the step still awaits its output
    (with a younger step in flight too), the corrected output is then accepted, and the run
    goes on exactly as one that never saw the bad output."""

    def run(with_bad_output: bool) -> list[Any]:
        s = _decode_scheduler(make_scheduler, offline)
        steps = [s.schedule() for _ in range(in_flight)]
        if with_bad_output:
            with pytest.raises(InvalidArgumentError, match=r"sampled_token_ids\[0\]"):
                s.update_from_output(steps[0], _sampled(steps[0], lambda rid: ["x"]))
            s.core.check_invariants()
        seen = []
        for out in steps:
            outs = s.update_from_output(out, _sampled(out, lambda rid: [44]))
            seen.append(sorted((o.request_id, o.new_token_ids) for o in outs[0].outputs))
        out = s.schedule()
        seen.append(dict(out.num_scheduled_tokens))
        s.core.check_invariants()
        return seen

    assert run(with_bad_output=True) == run(with_bad_output=False)


@pytest.mark.parametrize(
    ("ids", "drafts", "error", "match"),
    [
        (["r0", "r1"], [[50, 51, 52]], InvalidArgumentError, "2 req_ids but 1 draft lists"),
        (["r0", "r1"], [[50, 51, 52], ["a", 1, 2]], ArgumentTypeError, r"draft_token_ids\[1\]"),
        (["r0", "r1"], [[50, 51, 52], [1, 2, 3, 4]], InvalidArgumentError, "K = 3"),
        (["r1", "r0"], [[50, 51, 52], [1, 2, 3, 4]], InvalidArgumentError, "K = 3"),
        (["r0", "r1"], [[50, 51, 52], [-1, 2, 3]], InvalidArgumentError, r"\[0, 2\*\*31 - 1\]"),
    ],
)
def test_bad_draft_token_ids_raise_typed_errors_and_change_nothing(
    make_scheduler: Any, offline: Any, ids: list[str], drafts: Any, error: type, match: str
) -> None:
    """In the step's order (the one-pass path) and in any other (by id)."""
    s = _decode_scheduler(make_scheduler, offline, n=2)
    s.update_draft_token_ids(DraftTokenIds(["r0", "r1"], [[60, 61, 62], [70, 71, 72]]))
    with pytest.raises(error, match=match):
        s.update_draft_token_ids(DraftTokenIds(ids, drafts))
    out = s.schedule()  # the drafts installed before the refusal, untouched
    assert out.scheduled_spec_decode_tokens == {"r0": [60, 61, 62], "r1": [70, 71, 72]}
    s.core.check_invariants()


def test_the_step_containers_of_ints_and_strs_are_left_out_of_the_cyclic_collector(
    make_scheduler: Any, offline: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lists a step hands vLLM hold ints and strs only (or such lists), so they are built
    untracked by the cyclic collector, as vLLM's own ``EngineCoreOutput`` structs are: every
    collection would otherwise walk several hundred of them a step. They still behave as the
    plain lists and dicts they are."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # V1: all_token_ids are sent too
    s = _decode_scheduler(make_scheduler, offline)
    assert not s._out.v2
    ids = ["r0", "r1", "r2"]
    for _ in range(8):  # until a step hands out new blocks (every draft accepted)
        s.update_draft_token_ids(DraftTokenIds(ids, [[50, 51, 52]] * 3))
        s._out.bridge.forget_previous_step()  # the V1 runner then gets every all_token_ids
        out = s.schedule()
        cached = out.scheduled_cached_reqs
        blocks = [b for b in cached.new_block_ids if b is not None]
        if blocks:
            break
        s.update_from_output(out, _sampled(out, lambda rid: [50, 51, 52, 41]))
    assert blocks, "no step handed out new blocks"
    assert cached.req_ids == ids
    assert set(cached.all_token_ids) == set(ids)
    handed_out = [
        ("req_ids", cached.req_ids),
        ("new_block_ids", cached.new_block_ids),
        ("num_computed_tokens", cached.num_computed_tokens),
        ("num_output_tokens", cached.num_output_tokens),
        ("scheduled_spec_decode_tokens", out.scheduled_spec_decode_tokens),
        *((f"new_block_ids[{i}]", b) for i, b in enumerate(blocks)),
        *((f"new_block_ids[{i}][0]", b[0]) for i, b in enumerate(blocks)),
        *((f"all_token_ids[{r}]", t) for r, t in cached.all_token_ids.items()),
    ]
    tracked = [name for name, obj in handed_out if gc.is_tracked(obj)]
    assert not tracked, f"tracked by the cyclic collector: {tracked}"
    outputs = s.update_from_output(out, _sampled(out, lambda rid: [41]))
    (eco,) = outputs.values()
    assert [o.request_id for o in eco.outputs] == ids
    assert not gc.is_tracked(eco.outputs)
    cached.new_block_ids[0] = ([1, 2],)  # still the caller's own lists
    cached.req_ids.append("r9")
    assert cached.req_ids[-1] == "r9"


def test_scheduler_outputs_are_built_directly_and_equal_vllms_own(
    make_scheduler: Any, offline: Any
) -> None:
    """``SchedulerOutput`` and its ``CachedRequestData`` are built from a template of their
    fields (``dataclass_build``): vLLM's types, equal attribute by attribute to what their
    constructors make from the same fields, and each step gets new containers where the
    dataclass has a ``default_factory``."""
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    s = _decode_scheduler(make_scheduler, offline, n=2)
    assert s._out.bridge.builds_step_directly
    held = []
    for _ in range(2):
        out = _step_with_drafts(s, {"r0": [50, 51, 52], "r1": [53, 54, 55]})
        assert type(out) is SchedulerOutput
        assert type(out.scheduled_cached_reqs) is CachedRequestData
        for obj in (out, out.scheduled_cached_reqs):
            given = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
            assert vars(obj) == vars(type(obj)(**given))
            assert list(vars(obj)) == list(given)  # field order, as the constructor sets them
        assert out.scheduled_cached_reqs.req_ids == ["r0", "r1"]
        assert out.scheduled_spec_decode_tokens == {"r0": [50, 51, 52], "r1": [53, 54, 55]}
        assert out.num_spec_tokens_to_schedule == K
        held.append(out)
    for f in dataclasses.fields(SchedulerOutput):
        if f.default_factory is not dataclasses.MISSING:
            assert getattr(held[0], f.name) is not getattr(held[1], f.name), f.name


def test_engine_core_outputs_are_built_directly_and_equal_vllms_own(
    make_scheduler: Any, offline: Any
) -> None:
    """The bridge fills each ``EngineCoreOutput``'s slots itself (``struct_slots``): the result
    is vLLM's type, equal field by field to what vLLM's constructor makes, and serialises to
    the same bytes with vLLM's own encoder; a final output carries its finish and stop reason."""
    import sys

    import msgspec
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.serial_utils import MsgpackEncoder

    s = make_scheduler(method="dflash", num_speculative_tokens=K, num_blocks=128)
    assert s._out.bridge.builds_outputs_directly
    s.add_request(offline.request("r0", [20] * 20, 60))
    s.add_request(offline.request("r1", [21] * 20, 2))
    out = s.schedule()
    s.update_from_output(out, _sampled(out, lambda rid: [40]))  # first outputs: slow path
    out = s.schedule()
    sampled = {"r0": [41], "r1": [42]}
    mro = _sampled(out, sampled.__getitem__)
    before = (sys.getrefcount(sampled["r0"]), sys.getrefcount(sampled["r1"]))
    outs = s.update_from_output(out, mro)[0].outputs
    # Each output holds one reference to the runner's list, and nothing else keeps one.
    after = (sys.getrefcount(sampled["r0"]), sys.getrefcount(sampled["r1"]))
    assert after == (before[0] + 1, before[1] + 1)
    by_id = {o.request_id: o for o in outs}
    running, final = by_id["r0"], by_id["r1"]
    expected = {
        "r0": EngineCoreOutput("r0", [41]),
        "r1": EngineCoreOutput("r1", [42], finish_reason=FinishReason.LENGTH, stop_reason=None),
    }
    encoder = MsgpackEncoder()
    for rid, eco in by_id.items():
        assert type(eco) is EngineCoreOutput
        assert eco == expected[rid]
        assert msgspec.structs.asdict(eco) == msgspec.structs.asdict(expected[rid])
        assert encoder.encode(eco) == encoder.encode(expected[rid])
        assert eco.new_token_ids is sampled[rid]  # the runner's own list, as vLLM hands on
    assert running.finish_reason is None and final.finished
    del outs, by_id, running, final, eco
    assert (sys.getrefcount(sampled["r0"]), sys.getrefcount(sampled["r1"])) == before


def test_a_struct_type_the_bridge_cannot_fill_directly_is_called(
    make_scheduler: Any, offline: Any
) -> None:
    """An output class whose layout the bridge does not know how to fill (here: one with a
    ``__post_init__``, and one with a mutable default) is called instead, so what it builds is
    exactly what the class builds."""
    import msgspec
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    from dflash_rs._core import _VllmBridge

    made: list[str] = []

    class Recorded(EngineCoreOutput, gc=False):
        def __post_init__(self) -> None:
            made.append(self.request_id)

    class WithList(msgspec.Struct, gc=False):
        request_id: str
        new_token_ids: list
        finish_reason: Any = None
        stop_reason: Any = None
        seen: list = []

    for cls in (Recorded, WithList):
        s = make_scheduler(method="dflash", num_speculative_tokens=K, num_blocks=128)
        bridge = _VllmBridge(
            s.core,
            SchedulerOutput,
            CachedRequestData,
            cls,
            FinishReason,
            stats=(SchedulerStats, PrefixCacheStats, SpecDecodingStats),
            v2=True,
            async_scheduling=False,
        )
        assert not bridge.builds_outputs_directly
        s._out.bridge = bridge
        s.add_request(offline.request("r0", [20] * 20, 60))
        out = s.schedule()
        s.update_from_output(out, _sampled(out, lambda rid: [40]))
        out = s.schedule()
        (eco,) = s.update_from_output(out, _sampled(out, lambda rid: [41]))[0].outputs
        assert type(eco) is cls and (eco.request_id, eco.new_token_ids) == ("r0", [41])
    assert made == ["r0"]


@pytest.mark.parametrize("token", [0, 1, 255, 256, 2**30 - 1, 2**30, 2**31 - 1])
def test_token_ids_at_the_edges_of_an_ints_digits_are_read_exactly(
    make_scheduler: Any, offline: Any, token: int
) -> None:
    """Sampled and draft tokens of one 30-bit digit are read from the int in place
    (``compact_int``), larger ones through the API: both give the value itself."""
    s = _decode_scheduler(make_scheduler, offline, n=2)
    out = _step_with_drafts(s, {"r0": [token, 5, 6], "r1": [7, token, 8]})
    assert out.scheduled_spec_decode_tokens == {"r0": [token, 5, 6], "r1": [7, token, 8]}
    out = s.schedule()
    outs = s.update_from_output(out, _sampled(out, lambda rid: [token]))
    assert {o.request_id: o.new_token_ids for o in outs[0].outputs} == {
        "r0": [token],
        "r1": [token],
    }
    s.core.check_invariants()


@pytest.mark.parametrize("token", [-1, -(2**30), 2**31, 2**62, 2**64, True])
def test_token_ids_outside_the_range_are_refused(
    make_scheduler: Any, offline: Any, token: int
) -> None:
    s = _decode_scheduler(make_scheduler, offline, n=2)
    out = s.schedule()
    with pytest.raises((InvalidArgumentError, ArgumentTypeError), match=r"sampled_token_ids\[1\]"):
        s.update_from_output(out, _sampled(out, lambda rid: [40] if rid == "r0" else [token]))
    with pytest.raises((InvalidArgumentError, ArgumentTypeError), match=r"draft_token_ids\[0\]"):
        s.update_draft_token_ids(DraftTokenIds(["r0", "r1"], [[token, 1, 2], [3, 4, 5]]))
    outs = s.update_from_output(out, _sampled(out, lambda rid: [40]))
    assert len(outs[0].outputs) == 2
    s.core.check_invariants()


def test_stats_are_built_directly_and_equal_vllms_own(make_scheduler: Any, offline: Any) -> None:
    """``SchedulerStats`` and the stats in it are built by setting their fields
    (``dataclass_build``): each equals, attribute by attribute, what the class's own
    constructor makes from the same fields, and the defaults that are containers are new ones
    each step, as the constructor's ``default_factory`` makes them."""
    import dataclasses

    from vllm.v1.metrics.stats import PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    s = _decode_scheduler(make_scheduler, offline, n=2)
    assert s._out.bridge.builds_stats_directly
    held = []
    for _ in range(2):
        s.update_draft_token_ids(DraftTokenIds(["r0", "r1"], [[50, 51, 52], [53, 54, 55]]))
        out = s.schedule()
        assert len(out.scheduled_spec_decode_tokens) == 2
        outs = s.update_from_output(out, _sampled(out, lambda rid: [50, 41]))
        stats = outs[0].scheduler_stats
        spec, prefix = stats.spec_decoding_stats, stats.prefix_cache_stats
        assert type(stats) is SchedulerStats and type(prefix) is PrefixCacheStats
        assert type(spec) is SpecDecodingStats
        given = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
        assert vars(spec) == vars(SpecDecodingStats(**given))
        assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (2, 6, 2)
        assert spec.num_accepted_tokens_per_pos == [2, 0, 0]
        assert vars(prefix) == vars(PrefixCacheStats(**vars(prefix)))
        expected = SchedulerStats(
            num_running_reqs=2,
            num_waiting_reqs=0,
            num_skipped_waiting_reqs=0,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_stats=prefix,
            spec_decoding_stats=spec,
        )
        assert vars(stats) == vars(expected)
        held.append(stats)
    for f in dataclasses.fields(SchedulerStats):
        if f.default_factory is not dataclasses.MISSING and f.name != "prefix_cache_stats":
            assert getattr(held[0], f.name) is not getattr(held[1], f.name), f.name
