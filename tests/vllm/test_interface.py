"""Signature drift: vLLM's ``SchedulerInterface`` as the drop-in was written against (0.32 and
0.33, which differ only by ``has_request``, new in 0.33).

``test_interface_unchanged`` fails when the installed vLLM adds, removes or changes a method of
``SchedulerInterface`` (abstract or not: name, parameters, kinds, defaults, annotations) from its
series' record in ``INTERFACES``. Then ``DFlashRsScheduler`` must be checked against the new
contract and the record updated.
The other tests check that ``DFlashRsScheduler`` implements every abstract member with a
compatible signature and is instantiable.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM is not installed here; run these tests with scripts/vllm_env.sh",
)

from vllm.v1.core.sched.interface import PauseState, SchedulerInterface

from dflash_rs.vllm import DFlashRsScheduler
from dflash_rs.vllm._compat import installed

_P = "POSITIONAL_OR_KEYWORD"

#: name -> (abstract, parameters after self as (name, kind, default, annotation), return), or
#: (abstract, "property", type) for properties. Defaults: repr of literals, <TypeName> otherwise.
INTERFACE_0_33: dict[str, tuple[Any, ...]] = {
    "__init__": (
        True,
        (
            ("vllm_config", _P, None, "VllmConfig"),
            ("kv_cache_config", _P, None, "KVCacheConfig"),
            ("structured_output_manager", _P, None, "StructuredOutputManager"),
            ("block_size", _P, None, "int"),
            ("hash_block_size", _P, None, "int"),
            (
                "mm_registry",
                _P,
                "<MultiModalRegistry>",
                "vllm.multimodal.registry.MultiModalRegistry",
            ),
            ("include_finished_set", _P, "False", "bool"),
            ("log_stats", _P, "False", "bool"),
        ),
        "None",
    ),
    "add_request": (True, (("request", _P, None, "Request"),), "None"),
    "finish_requests": (
        True,
        (
            ("request_ids", _P, None, "str | collections.abc.Iterable[str] | None"),
            ("finished_status", _P, None, "RequestStatus"),
        ),
        "list[Request]",
    ),
    "get_ec_connector": (False, (), "ECConnectorBase | None"),
    "get_grammar_bitmask": (
        True,
        (("scheduler_output", _P, None, "SchedulerOutput"),),
        "GrammarOutput | None",
    ),
    "get_kv_cache_usage": (False, (), "float"),
    "get_kv_connector": (False, (), "KVConnectorBase_V1 | None"),
    "get_kv_event_publisher_config": (False, (), "KVEventsConfig | None"),
    "get_num_unfinished_requests": (True, (), "int"),
    "get_request_counts": (True, (), "tuple[int, int]"),
    "has_finished_requests": (True, (), "bool"),
    "has_request": (True, (("request_id", _P, None, "str"),), "bool"),
    "has_requests": (False, (), "bool"),
    "has_unfinished_requests": (False, (), "bool"),
    "make_stats": (True, (), "SchedulerStats | None"),
    "pause_state": (True, "property", "vllm.v1.core.sched.interface.PauseState"),
    "reset_encoder_cache": (True, (), "None"),
    "reset_prefix_cache": (
        True,
        (
            ("reset_running_requests", _P, "False", "bool"),
            ("reset_connector", _P, "False", "bool"),
        ),
        "bool",
    ),
    "schedule": (True, (("throttle_prefills", _P, "False", "bool"),), "SchedulerOutput"),
    "set_pause_state": (
        True,
        (("pause_state", _P, None, "vllm.v1.core.sched.interface.PauseState"),),
        "None",
    ),
    "shutdown": (True, (), "None"),
    "update_draft_token_ids": (True, (("draft_token_ids", _P, None, "DraftTokenIds"),), "None"),
    "update_draft_token_ids_in_output": (
        True,
        (
            ("draft_token_ids", _P, None, "DraftTokenIds"),
            ("scheduler_output", _P, None, "SchedulerOutput"),
        ),
        "None",
    ),
    "update_from_output": (
        True,
        (
            ("scheduler_output", _P, None, "SchedulerOutput"),
            ("model_runner_output", _P, None, "ModelRunnerOutput"),
        ),
        "dict[int, 'EngineCoreOutputs']",
    ),
}

PAUSE_STATES_0_33 = {"UNPAUSED": 0, "PAUSED_NEW": 1, "PAUSED_ALL": 2}


def _default(d: Any) -> Optional[str]:
    if d is inspect.Parameter.empty:
        return None
    if d is None or isinstance(d, (bool, int, float, str)):
        return repr(d)
    return f"<{type(d).__name__}>"


def _annotation(a: Any) -> Optional[str]:
    if a is inspect.Parameter.empty:
        return None
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _describe(cls: type) -> dict[str, tuple[Any, ...]]:
    out = {}
    for name in sorted(dir(cls)):
        if name.startswith("_") and name != "__init__":
            continue
        attr = inspect.getattr_static(cls, name)
        if isinstance(attr, property):
            abstract = getattr(attr.fget, "__isabstractmethod__", False)
            ret = _annotation(inspect.signature(attr.fget).return_annotation)
            out[name] = (abstract, "property", ret)
            continue
        sig = inspect.signature(attr)
        params = tuple(
            (p.name, p.kind.name, _default(p.default), _annotation(p.annotation))
            for p in list(sig.parameters.values())[1:]
        )
        out[name] = (
            getattr(attr, "__isabstractmethod__", False),
            params,
            _annotation(sig.return_annotation),
        )
    return out


#: The interface of each supported series: 0.32 lacks ``has_request``.
INTERFACES = {
    "0.33": INTERFACE_0_33,
    "0.32": {n: spec for n, spec in INTERFACE_0_33.items() if n != "has_request"},
}
SERIES = installed().name
INTERFACE = INTERFACES[SERIES]


def test_interface_unchanged() -> None:
    import vllm

    now = _describe(SchedulerInterface)
    added = sorted(set(now) - set(INTERFACE))
    removed = sorted(set(INTERFACE) - set(now))
    changed = {
        n: (INTERFACE[n], now[n]) for n in set(now) & set(INTERFACE) if now[n] != INTERFACE[n]
    }
    assert not (added or removed or changed), (
        f"vLLM {vllm.__version__}'s SchedulerInterface drifted from {SERIES}: added {added}, "
        f"removed {removed}, changed (recorded, now) {changed}"
    )
    assert {s.name: s.value for s in PauseState} == PAUSE_STATES_0_33


def test_the_series_differ_only_by_has_request() -> None:
    """The drop-in implements ``has_request`` for both series (0.32's engine never calls it)."""
    assert set(INTERFACES["0.33"]) - set(INTERFACES["0.32"]) == {"has_request"}
    assert callable(DFlashRsScheduler.has_request)


def test_every_abstract_member_is_implemented() -> None:
    assert not DFlashRsScheduler.__abstractmethods__
    assert set(SchedulerInterface.__abstractmethods__) == {
        n for n, spec in INTERFACE.items() if spec[0]
    }
    for name in SchedulerInterface.__abstractmethods__:
        ours = inspect.getattr_static(DFlashRsScheduler, name)
        assert not getattr(ours, "__isabstractmethod__", False), name
        assert getattr(DFlashRsScheduler, name) is not getattr(SchedulerInterface, name), name


@pytest.mark.parametrize("name", sorted(n for n, s in INTERFACE.items() if s[1] != "property"))
def test_signature_compatible(name: str) -> None:
    """Every call the interface allows is a valid call of ours: same parameters in the same
    positions with the same kinds and defaults; extra parameters only with defaults."""
    theirs = list(inspect.signature(getattr(SchedulerInterface, name)).parameters.values())[1:]
    ours = list(inspect.signature(getattr(DFlashRsScheduler, name)).parameters.values())[1:]
    assert len(ours) >= len(theirs), (name, ours, theirs)
    for t, o in zip(theirs, ours):
        assert (o.name, o.kind) == (t.name, t.kind), (name, o, t)
        if t.default is not inspect.Parameter.empty:
            assert o.default is t.default or o.default == t.default, (name, o, t)
    for o in ours[len(theirs) :]:
        assert o.default is not inspect.Parameter.empty, (name, o)


def test_pause_state_is_a_property() -> None:
    assert isinstance(inspect.getattr_static(DFlashRsScheduler, "pause_state"), property)


def test_engine_attributes(scheduler: Any) -> None:
    """What EngineCore reads besides the interface: ``connector`` and ``ec_connector``."""
    assert isinstance(scheduler, SchedulerInterface)
    assert scheduler.connector is None and scheduler.ec_connector is None
    assert scheduler.get_kv_connector() is None
    assert scheduler.get_ec_connector() is None
    assert scheduler.get_kv_event_publisher_config() is None
    assert scheduler.pause_state == PauseState.UNPAUSED
    assert not scheduler.has_requests()
    scheduler.shutdown()
