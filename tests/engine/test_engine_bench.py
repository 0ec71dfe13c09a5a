"""``benches/vllm_engine_e2e.py`` runs end to end in vLLM's CPU engine, and
``benches/vllm_server_e2e.py`` behind its OpenAI-compatible server (two engines each: slow).
That ``--clock`` picks the clock is checked without an engine, in
``tests/bench/test_engine_bench_clock.py``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

BENCH = Path(__file__).resolve().parents[2] / "benches" / "vllm_engine_e2e.py"


def test_the_engine_bench_runs_end_to_end_with_the_cpu_clock(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, str(BENCH), "--n", "4", "--spec", "none", "--reps", "1"]
    cmd += ["--prompt-len", "8", "--gen-len", "4", "--warmup-requests", "1", "--threads", "1"]
    cmd += ["--clock", "cpu", "--breakdown", "--json", str(out)]
    subprocess.run(cmd, check=True, timeout=600, capture_output=True)
    doc = json.loads(out.read_text())
    assert doc["timing"].startswith("steps and scheduler calls in the engine thread's CPU time")
    assert {run["side"] for run in doc["runs"]} == {"vllm", "dflash-rs"}
    for run in doc["runs"]:
        (result,) = run["results"]
        assert result["steps"] > 0
        assert 0 < result["sched_share"] < 1
        # The engine thread's CPU time in its steps is at most the generate call's wall time.
        assert 0 < result["step_total_s"] <= result["generate_s"]
        if run["side"] == "vllm":
            assert "bridge_s_by_method" not in result  # no bridge to time
            continue
        # --breakdown: the Rust bridge's calls happen inside the scheduler's.
        bridge_s = result["bridge_s_by_method"]
        assert {"schedule", "engine_outputs", "scheduler_stats"} <= set(bridge_s)
        assert 0 < sum(bridge_s.values()) < result["sched_s"]
        assert result["adapter_python_s"] > 0


SERVER_BENCH = BENCH.with_name("vllm_server_e2e.py")


def test_the_server_bench_runs_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "server.json"
    cmd = [sys.executable, str(SERVER_BENCH), "--n", "4", "--spec", "none", "--reps", "1"]
    cmd += ["--batches", "2", "--prompt-len", "8", "--gen-len", "4", "--json", str(out)]
    subprocess.run(cmd, check=True, timeout=900, capture_output=True)
    doc = json.loads(out.read_text())
    assert {run["side"] for run in doc["runs"]} == {"vllm", "dflash-rs"}
    for run in doc["runs"]:
        assert "error" not in run, run
        (result,) = run["results"]
        assert len(result["batch_wall_s"]) == 2
        assert result["tok_s"] > 0
        assert 0 < result["latency_p50_s"] <= result["latency_p99_s"]
    cell = doc["summary"]["none/4"]
    assert cell["paired_tok_s_ratio"]["median"] > 0
    assert isinstance(cell["outputs_identical"], bool)
