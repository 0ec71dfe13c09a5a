"""``dflash-rs simulate`` end to end: in a subprocess and in-process, exit codes included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_rs import cli
from dflash_rs.sim import cli as simulate_cli

from .helpers import SMALL_ARGS


def test_subprocess_smoke(tmp_path: Path) -> None:
    report, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    command = [sys.executable, "-m", "dflash_rs", "simulate", *SMALL_ARGS]
    command += ["--json", str(report), "--plot", str(plot)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=300, env={**os.environ}, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "integrity    0 violations" in done.stdout
    assert done.stdout.splitlines()[-2].startswith("OK")  # then "wrote ..."
    assert json.loads(report.read_text())["requests_finished"] == 24
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", *SMALL_ARGS, "--method", "eagle", "-k", "2"]) == 0
    out = capsys.readouterr().out
    assert "eagle K=2" in out and out.rstrip().splitlines()[-1].startswith("OK")


def test_quiet_prints_only_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["simulate", *SMALL_ARGS, "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [
        "OK: every KV slot read back held its reader's own value"
    ]


def test_legacy_policy_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", *SMALL_ARGS, "--lookahead-policy", "legacy-first-prefill"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "null block" in out


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--acceptance-rate", "1.5"], ["--kernel", "cuda"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["simulate", *argv])
        assert exc.value.code == 2
        assert f"argument {argv[0]}" in capsys.readouterr().err


def test_simulate_is_the_default_command(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(simulate_cli, "run", lambda args: seen.append(args.seed) or 0)
    assert cli.main([]) == 0
    assert seen == [0]
    assert cli.main(["demo", "--num-requests", "1"]) == 0  # demo is still there
