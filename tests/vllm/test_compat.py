"""The compatibility table (``dflash_rs.vllm._compat``) against the installed vLLM wheel: every
fact it records for the installed series is checked on vLLM's own objects, so a wrong entry
fails in the venv of that series (``scripts/vllm_env.sh`` builds one per supported series)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

# Not "vllm" alone: in the main venv this directory itself imports as a namespace package.
pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM is not installed here; run these tests with scripts/vllm_env.sh",
)

import vllm
from vllm.config import VllmConfig
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput

from dflash_rs.errors import UnsupportedFeatureError
from dflash_rs.vllm._compat import SUPPORTED_SERIES, installed, series_of

SERIES = installed()


def test_the_installed_version_is_a_supported_series() -> None:
    assert SERIES.version == vllm.__version__
    assert SERIES.name in SUPPORTED_SERIES


def test_other_series_are_refused_by_name() -> None:
    assert series_of("0.33.1+cpu").name == "0.33"
    with pytest.raises(UnsupportedFeatureError, match=r"0\.32 and 0\.33"):
        series_of("0.31.0")


def test_engine_core_output_error() -> None:
    # A msgspec struct: its field names are __struct_fields__.
    assert ("error" in EngineCoreOutput.__struct_fields__) == SERIES.output_has_error


def test_hash_lookahead_tokens() -> None:
    assert hasattr(VllmConfig, "num_hash_lookahead_tokens") == SERIES.has_hash_lookahead_tokens
    params = inspect.signature(get_request_block_hasher).parameters
    assert (len(params) == 3) == SERIES.has_hash_lookahead_tokens


def test_scheduler_output_fields_new_in_0_33_have_neutral_defaults() -> None:
    """The drop-in never sets ``skip_drafts`` or ``encoder_input_updates``: where they exist,
    their defaults must mean "draft as usual" and "no update"."""
    fields = {f.name: f for f in dataclasses.fields(SchedulerOutput)}
    new = {"skip_drafts", "encoder_input_updates"}
    assert (new <= set(fields)) == (SERIES.name == "0.33")
    if SERIES.name == "0.33":
        assert fields["skip_drafts"].default is False
        assert fields["encoder_input_updates"].default_factory() == {}


def test_local_prefill_cadence() -> None:
    """Only a series whose Scheduler keeps a local prefill interval applies
    ``prefill_schedule_interval`` itself; both take ``schedule(throttle_prefills)``."""
    init = inspect.getsource(Scheduler.__init__)
    assert ("self.local_prefill_interval" in init) == SERIES.has_local_prefill_cadence
    assert "throttle_prefills" in inspect.signature(Scheduler.schedule).parameters


def test_a_scheduler_under_another_series_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Built under a vLLM series it does not know (0.34 changed the shape of the objects the
    scheduler reads and hands out), ``DFlashRsScheduler`` raises the version's error before it
    reads any of vLLM's config: never an ``AttributeError`` from a config of another shape."""
    from dflash_rs.vllm import DFlashRsScheduler

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    installed.cache_clear()
    try:
        with pytest.raises(UnsupportedFeatureError, match=r"0\.32 and 0\.33, found 0\.34\.0"):
            DFlashRsScheduler(object(), object(), None, block_size=32)
    finally:
        monkeypatch.undo()
        installed.cache_clear()
    assert installed().version == vllm.__version__
