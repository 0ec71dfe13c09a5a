"""``dflash-rs bench`` at tiny sizes: alone (table, JSON keys, exit codes), the
``benches/scheduler_bench.py`` wrapper, and side by side with vLLM's scheduler (slow; only
where a vLLM venv exists)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_rs import cli
from dflash_rs.bench import baseline

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
TINY = ["--n-reqs", "4,8", "--reps", "1", "--warmup-steps", "2", "--measure-steps", "5"]
TINY += ["--preempt-n", "8", "--micro-iters", "20"]
TOP_KEYS = {
    "what",
    "versions",
    "machine",
    "args",
    "total_wall_s",
    "aggregate",
    "micro_aggregate",
    "runs",
    "micro_runs",
    "baseline",
    "comparison",
}


def _bench(*extra: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dflash_rs", "bench", *TINY, *extra]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=300, cwd=cwd, env={**os.environ}
    )


def test_subprocess_all_modes_table_and_json(tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    done = _bench("--modes", "decode,serve,preempt,micro", "--json", str(report))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    header = next(line for line in out.splitlines() if "sched p50" in line)
    assert [c.strip() for c in header.strip("|").split("|")][:4] == ["mode", "spec", "N", "path"]
    assert "Admission, Request() + add_request()" in out
    doc = json.loads(report.read_text())
    assert set(doc) == TOP_KEYS
    assert doc["baseline"] is None and doc["comparison"] == []
    keys = {(r["mode"], r["n"], r["path"]) for r in doc["aggregate"]}
    for path in ("arrays", "lists"):
        assert {("decode", 4, path), ("decode", 8, path), ("serve", 8, path)} <= keys
        assert ("preempt", 8, path) in keys
    for row in doc["aggregate"]:
        assert row["spec"] == "dflash" and row["reps"] == 1
        for phase in ("schedule", "spec", "update", "drafts", "total"):
            assert row[f"{phase}_p50_us"] > 0, (row, phase)
        assert row["total_p99_us"] >= row["total_p50_us"]
        assert row["measured_steps"] == 5
    decode = next(r for r in doc["aggregate"] if r["mode"] == "decode" and r["n"] == 8)
    assert decode["mean_sched_tokens"] == 8 * 9  # pure decode, K=8 drafts + 1 per request
    assert "admit_1100_arrays" in doc["micro_aggregate"]


def test_in_process_method_k_and_quiet(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    argv = ["bench", *TINY, "--modes", "decode", "--method", "eagle", "-k", "2"]
    report = tmp_path / "new" / "b.json"  # its folder is made
    argv += ["--paths", "arrays", "--clock", "cpu", "--quiet", "--json", str(report)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "rep 0" not in out and "total wall time" not in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| decode")]
    assert [[c.strip() for c in r[1:5]] for r in rows] == [
        ["decode", "eagle", "4", "arrays"],
        ["decode", "eagle", "8", "arrays"],
    ]
    doc = json.loads(report.read_text())
    assert [r["mean_sched_tokens"] for r in doc["aggregate"]] == [4 * 3, 8 * 3]


def test_paths_replay_the_same_trace(tmp_path: Path) -> None:
    """The three paths drive the same steps: the README's loop (lists) and the arrays path
    verify the runner's own drafts (``--check`` asserts they are the scheduled ones), the
    vLLM-style path the drafts of ``scheduled_spec_decode_tokens``."""
    report = tmp_path / "b.json"
    argv = ["bench", *TINY, "--modes", "decode,serve", "--paths", "arrays,lists,lists_spec_dict"]
    assert cli.main([*argv, "--check", "--clock", "cpu", "--quiet", "--json", str(report)]) == 0
    rows = json.loads(report.read_text())["aggregate"]
    by_path: dict = {}
    for r in rows:
        by_path.setdefault(r["path"], []).append(
            (r["mode"], r["n"], r["mean_sched_tokens"], r["mean_accepted"], r["mean_finished"])
        )
    assert set(by_path) == {"arrays", "lists", "lists_spec_dict"}
    assert by_path["arrays"] == by_path["lists"] == by_path["lists_spec_dict"]
    assert all(r["mean_accepted"] > 0 for r in rows)


def test_bad_mode_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", *TINY, "--modes", "decode,bogus"])
    assert exc.value.code == 2
    assert "argument --modes: unknown 'bogus'" in capsys.readouterr().err


def test_missing_baseline_python_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", *TINY, "--modes", "decode", "--paths", "arrays"]
    assert cli.main([*argv, "--baseline-python", "/nonexistent/python"]) == 1
    captured = capsys.readouterr()
    assert "baseline failed" in captured.err
    assert "| decode |" in captured.out  # ours is still printed


def test_wrapper_script_dump_prompt_hashes() -> None:
    script = REPO / "benches" / "scheduler_bench.py"
    command = [sys.executable, str(script), "--n-reqs", "4", "--dump-prompt-hashes", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert set(doc) == {"4000", "256000"} and all(len(h) == 2 for h in doc.values())


def test_driver_is_shipped_and_standalone() -> None:
    path = Path(baseline.driver_path())
    assert path.is_file() and path.parent.name == "bench"
    source = path.read_text()
    assert "import dflash_rs" not in source and "from dflash_rs" not in source


def _vllm_skip_reason() -> str:
    if not VLLM_PYTHON.exists():
        return f"no vLLM venv at {VLLM_PYTHON}"
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm"],
        capture_output=True,
        timeout=180,
        check=False,
    )
    return "" if probe.returncode == 0 else f"vllm is not importable by {VLLM_PYTHON}"


@pytest.mark.slow
def test_side_by_side_with_vllm(tmp_path: Path) -> None:
    reason = _vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    report = tmp_path / "bench.json"
    done = _bench(
        "--modes", "decode,serve", "--baseline-python", str(VLLM_PYTHON), "--json", str(report)
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "prompts identical (sha256)" in done.stdout
    doc = json.loads(report.read_text())
    base = doc["baseline"]
    assert base["prompts_identical"] and base["versions"]["vllm"]
    assert len(doc["comparison"]) == 2 * 2 * 2  # decode and serve, N = 4 and 8, two paths
    for row in doc["comparison"]:
        # the same workload on both sides: same tokens scheduled per step
        assert row["tok_per_step_ours"] == row["tok_per_step_vllm"], row
        assert row["total_p50_us_vllm"] > 0 and row["total_ratio"] > 0
