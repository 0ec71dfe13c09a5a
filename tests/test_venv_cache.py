"""The cached venvs' bookkeeping (``scripts/lib/wheel_venvs.sh``, ``scripts/prune_cache.sh``):
CI keeps the venvs its run used and removes those left from older pins."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bash(script: str, cache: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, DFLASH_RS_CACHE=str(cache))
    return subprocess.run(
        ["bash", "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )


def make_venv(cache: Path, name: str) -> Path:
    venv = cache / name
    (venv / "bin").mkdir(parents=True)
    (venv / ".complete").touch()
    return venv


def test_prune_removes_the_venvs_a_run_did_not_use(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale = make_venv(cache, "venv-vllm-0.31.0-aaaaaaaaaaaa")
    never_marked = make_venv(cache, "venv-python-3.9-bbbbbbbbbbbb")
    used = make_venv(cache, "venv-vllm-0.33.0-cccccccccccc")
    (cache / ".vllm-cpu.lock").touch()
    (stale / ".last-used").touch()
    old = time.time() - 3600
    os.utime(stale / ".last-used", (old, old))
    marker = tmp_path / "marker"
    marker.touch()
    os.utime(marker, (old + 60, old + 60))

    mark = bash(f"source scripts/lib/wheel_venvs.sh && note_venv_use {used}", cache)
    assert mark.returncode == 0, mark.stderr
    prune = bash(f"scripts/prune_cache.sh {marker}", cache)

    assert prune.returncode == 0, prune.stderr
    assert used.is_dir() and not stale.exists() and not never_marked.exists()
    assert (cache / ".vllm-cpu.lock").exists()
    assert str(stale) in prune.stdout and str(never_marked) in prune.stdout
    assert str(used) not in prune.stdout


def test_prune_needs_its_marker(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    venv = make_venv(cache, "venv-kernels-newest-dddddddddddd")
    prune = bash(f"scripts/prune_cache.sh {tmp_path / 'missing'}", cache)
    assert prune.returncode == 2 and "no marker" in prune.stderr
    assert venv.is_dir()


def test_a_cached_venv_in_use_is_marked(tmp_path: Path) -> None:
    """``cached_venv`` marks the venv it returns, an existing one as well as a new one."""
    cache = tmp_path / "cache"
    pin = "six==1.16.0"
    key = subprocess.run(
        ["bash", "-c", f"printf '%s\\n' '{pin}' | sha256sum | cut -c1-12"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    venv = make_venv(cache, f"venv-example-{key}")
    got = bash(f"source scripts/lib/wheel_venvs.sh && cached_venv example python3 '' {pin}", cache)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip() == str(venv)
    assert (venv / ".last-used").exists()
