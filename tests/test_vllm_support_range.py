"""The vLLM versions the package declares (the ``vllm`` extra), the series the drop-in knows
(``dflash_rs.vllm``) and the versions its parity suite runs against (the Makefile) name the same
series: a range widened without a tested series, or a series added without the range, fails
here, in the main venv (no vLLM needed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # CPython 3.11+
from packaging.requirements import Requirement  # noqa: E402

from dflash_rs.vllm._compat import SUPPORTED_SERIES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def series(version: str) -> str:
    return ".".join(version.split(".")[:2])


def next_series(name: str) -> str:
    major, minor = name.split(".")
    return f"{major}.{int(minor) + 1}"


def vllm_extra() -> Requirement:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(r) for r in project["optional-dependencies"]["vllm"]]
    assert requirement.name == "vllm"
    return requirement


def test_the_vllm_extra_admits_exactly_the_supported_series() -> None:
    spec = vllm_extra().specifier
    for name in SUPPORTED_SERIES:
        assert spec.contains(f"{name}.0") and spec.contains(f"{name}.9"), name
    oldest, newest = SUPPORTED_SERIES[0], SUPPORTED_SERIES[-1]
    major, minor = oldest.split(".")
    assert not spec.contains(f"{major}.{int(minor) - 1}.9")
    assert not spec.contains(f"{next_series(newest)}.0")


def test_the_parity_suite_runs_one_version_of_every_supported_series() -> None:
    makefile = (REPO / "Makefile").read_text()
    (line,) = re.findall(r"^VLLM_VERSIONS := (.+)$", makefile, flags=re.M)
    versions = line.split()
    assert sorted(series(v) for v in versions) == sorted(SUPPORTED_SERIES)
    spec = vllm_extra().specifier
    assert all(spec.contains(v) for v in versions)


def test_the_readme_states_the_extra() -> None:
    readme = (REPO / "README.md").read_text()
    (stated,) = re.findall(r"pip install 'dflash-rs\[vllm\]' +# (vllm\S+)$", readme, flags=re.M)
    assert Requirement(stated).specifier == vllm_extra().specifier
