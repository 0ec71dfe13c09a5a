"""Triton settings that change compilation (``_COMPILE_SETTINGS``) keep launches on the JIT.

A plan's direct launch calls a kernel compiled earlier. While one of those settings is set (an
FP sanitizer mode, a hook on the compiler's stages) every launch goes through Triton's JIT, and
what the JIT compiles then is not kept for direct launches. The plan's launcher and the JIT are
stand-ins here, so this runs without a GPU and on every Triton version that has the settings.
"""

from __future__ import annotations

import contextlib
import os
import re

import pytest
import triton
from test_dflash_expand_validation import _call, _good

import dflash_rs.kernels.dflash_expand as kernel_module
from dflash_rs.kernels import DFlashInputs
from dflash_rs.kernels.dflash_expand import ExpandLaunch

if not hasattr(triton, "knobs"):  # Triton < 3.4: no settings, and no direct launches
    pytest.skip("Triton before triton.knobs", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":  # with a GPU, a call on CPU tensors makes no plan
    pytest.skip(
        "the plan is made by a call on CPU tensors: needs TRITON_INTERPRET=1",
        allow_module_level=True,
    )

SET = {"fpsan_homomorphic_casts": True, "add_stages_inspection_hook": lambda *args: None}
PRESENT = [
    pytest.param(group, name, id=name)
    for group, name in kernel_module._COMPILE_SETTINGS
    if hasattr(getattr(triton.knobs, group), name)
]


def _triton_version() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", triton.__version__).groups()
    return int(major), int(minor)


@pytest.fixture
def plan(monkeypatch) -> ExpandLaunch:
    """A plan made by a call on CPU, that believes its tensors are on CUDA device 0."""
    out = DFlashInputs.empty(2, 5, 2, "cpu")
    _call({**_good("cpu"), "out": out})
    (plan,) = out._launch_plans.values()
    plan.device_index = 0
    monkeypatch.setattr(kernel_module, "_get_device", lambda: 0)
    monkeypatch.setattr(kernel_module, "_raw_stream", lambda index: 0)
    monkeypatch.setattr(kernel_module, "_direct_launch_ok", True)
    monkeypatch.setattr(kernel_module.torch.cuda, "device", lambda index: contextlib.nullcontext())
    return plan


@pytest.fixture
def launches(monkeypatch, plan) -> list[str]:
    """'jit' or 'direct' per launch; the JIT's compiled kernel is a stand-in that records too."""
    seen: list[str] = []

    class Compiled:
        function, packed_metadata = "function", "metadata"

        @staticmethod
        def run(*args) -> None:
            seen.append("direct")

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen.append("jit")
                return Compiled

            return launch

    monkeypatch.setattr(kernel_module, "_dflash_expand_kernel", Kernel())
    return seen


def _launch(plan: ExpandLaunch) -> None:
    plan.launch((), (), 2, 5)  # the stand-ins read no tensors


def test_without_the_settings_the_second_launch_is_direct(plan, launches):
    _launch(plan)
    _launch(plan)
    assert launches == ["jit", "direct"]
    assert len(plan._kernels) == 1


@pytest.mark.parametrize(("group", "name"), PRESENT)
def test_a_set_compile_setting_keeps_every_launch_on_the_jit(
    plan, launches, monkeypatch, group, name
):
    _launch(plan)  # compiled and kept before the setting is set
    monkeypatch.setattr(getattr(triton.knobs, group), name, SET[name])
    _launch(plan)
    _launch(plan)
    assert launches == ["jit", "jit", "jit"]


@pytest.mark.parametrize(("group", "name"), PRESENT)
def test_kernels_compiled_while_a_setting_is_set_are_not_kept(
    plan, launches, monkeypatch, group, name
):
    knobs = getattr(triton.knobs, group)
    with monkeypatch.context() as patch:
        patch.setattr(knobs, name, SET[name])
        _launch(plan)
        _launch(plan)
        assert not plan._kernels
    assert not getattr(knobs, name)
    _launch(plan)
    _launch(plan)
    assert launches == ["jit", "jit", "jit", "direct"]


def test_the_settings_exist_from_triton_3_9():
    """A renamed setting would otherwise be skipped silently."""
    if _triton_version() < (3, 9):
        pytest.skip("fpsan_homomorphic_casts is new in Triton 3.9")
    missing = [
        f"{group}.{name}"
        for group, name in kernel_module._COMPILE_SETTINGS
        if not hasattr(getattr(triton.knobs, group), name)
    ]
    assert not missing
