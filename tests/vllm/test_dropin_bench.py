"""``benches/vllm_dropin.py`` and ``benches/ab_builds.py --bench dropin``, the tools that measure
the drop-in's per-step cost: a tiny run of each, so they keep working as the adapter changes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

BENCHES = Path(__file__).resolve().parents[2] / "benches"
#: A few requests, a few steps: seconds, not a measurement.
TINY = [
    "--n", "4",
    "--reps", "1",
    "--warmup-steps", "1",
    "--measure-steps", "4",
    "--min-prompt", "16",
    "--max-prompt", "48",
    "--prefix-len", "16",
    "--max-tokens", "200",
    "--serve-max-tokens", "8",
]  # fmt: skip


def _dropin() -> Any:
    spec = importlib.util.spec_from_file_location("vllm_dropin", BENCHES / "vllm_dropin.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("mode", "lifetimes", "evict_kib", "finished"),
    [
        ("decode", "engine", 0, "freed"),
        ("decode", "phases", 0, "freed"),
        ("decode", "engine", 64, "freed"),
        ("serve", "engine", 0, "kept"),
    ],
)
def test_the_dropin_bench_times_both_sides_and_the_collector(
    tmp_path: Path, mode: str, lifetimes: str, evict_kib: int, finished: str
) -> None:
    out = tmp_path / "dropin.json"
    argv = [*TINY, "--modes", mode, "--gc-stats", "--lifetimes", lifetimes]
    argv += ["--evict-kib", str(evict_kib), "--finished-requests", finished]
    assert _dropin().main([*argv, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    cells = {(r["side"], r["mode"]) for r in runs}
    assert cells == {("vllm", mode), ("dflash-rs", mode)}
    for r in runs:
        assert r["p50_us"]["total"] > 0 and r["gc_runs_per_step"] >= 0 and r["gc_mean_us"] >= 0
    assert doc["summary"][f"paired_ratio/{mode}/4"]["median"] > 0
    assert len(doc["versions"]["core_so_sha256"]) == 16
    assert (doc["args"]["lifetimes"], doc["args"]["evict_kib"]) == (lifetimes, evict_kib)
    assert doc["args"]["finished_requests"] == finished


def test_the_dropin_bench_runs_without_speculation(tmp_path: Path) -> None:
    """``-k 0``: no speculative config on either side, so no drafts are scheduled or timed."""
    out = tmp_path / "dropin.json"
    assert _dropin().main([*TINY, "--modes", "decode", "-k", "0", "--json", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert {r["side"] for r in runs} == {"vllm", "dflash-rs"}
    for r in runs:
        assert r["p50_us"]["total"] > 0 and r["p50_us"]["drafts"] == 0


def test_ab_builds_runs_the_dropin_bench_against_each_build(tmp_path: Path) -> None:
    """The same build twice (an A/A run): both are loaded from their snapshot and compared."""
    import dflash_rs._core

    core = dflash_rs._core.__file__
    assert core is not None
    cmd = [
        sys.executable,
        str(BENCHES / "ab_builds.py"),
        core,
        core,
        "--rounds",
        "1",
        "--bench",
        "dropin",
        "--python",
        sys.executable,
        "--json",
        str(tmp_path / "ab.json"),
        "--",
        *TINY,
        "--modes",
        "serve",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "bench: vllm_dropin.py" in done.stdout
    assert "| serve N=4 | 1:" in done.stdout
    results = json.loads((tmp_path / "ab.json").read_text())["results"]
    assert [r["serve/4"]["total_p50_us"][0] > 0 for r in results] == [True, True]


def test_the_phase_hook_brackets_each_timed_phase_of_measured_steps(tmp_path: Path) -> None:
    """``PHASE_HOOK`` (what ``callgrind_dropin.py`` counts instructions with) opens and closes
    every timed phase of every measured step, in turn, and nothing else."""
    dropin = _dropin()
    calls: list[bool] = []
    dropin.PHASE_HOOK = calls.append
    argv = [*TINY, "--modes", "decode", "--sides", "dflash-rs", "--json", str(tmp_path / "d.json")]
    assert dropin.main(argv) == 0
    steps = json.loads((tmp_path / "d.json").read_text())["args"]["measure_steps"]
    # Decode: every measured step schedules, applies an output and installs drafts.
    assert calls == [True, False] * 3 * steps
