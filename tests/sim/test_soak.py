"""``dflash-rs soak``: a short run of the scheduler-only soak, in-process and through the CLI."""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import pytest

from dflash_rs import Request, Scheduler, cli
from dflash_rs.soak import (
    OwnershipCheck,
    SoakConfig,
    SoakReport,
    required_lookahead,
    rss_bytes,
    run_soak,
)

#: About 3 s on a 2-core CPU.
SHORT = 20_000


@pytest.fixture(scope="module")
def short_run() -> SoakReport:
    """The short soak, run in a fresh interpreter: its RSS check then measures the soak alone,
    not the allocations of the tests that ran before it in this process (which once moved a
    short run's RSS by just over the 5% it allows)."""
    spawn = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=spawn) as pool:
        return pool.submit(run_soak, SoakConfig(num_requests=SHORT, seed=3)).result()


def test_short_soak_accounts_for_every_request(short_run: SoakReport) -> None:
    r = short_run
    assert r.error is None
    assert r.requests_submitted == r.requests_finished == SHORT
    assert r.finished_ids_reported == SHORT  # each finished id reported exactly once
    assert sum(r.finish_reasons.values()) == SHORT
    assert r.requests_aborted == r.finish_reasons["abort"] > 0
    assert r.finish_reasons["length"] > 0 and r.finish_reasons.get("error", 0) == 0


def test_short_soak_leaks_nothing_and_violates_nothing(short_run: SoakReport) -> None:
    r = short_run
    assert r.violations == 0 and r.violation_records == []
    assert r.leaked_blocks == 0
    assert r.free_blocks_end == r.usable_blocks == r.config["num_blocks"] - 1
    assert r.kv_usage_end == 0.0
    assert r.full_checks >= r.steps // r.config["check_every"]
    assert r.ok


def test_short_soak_is_under_pressure(short_run: SoakReport) -> None:
    """The run exercises what it is meant to: preemption, prefix hits, drafts, RSS samples."""
    r = short_run
    assert r.preemptions > 0
    assert 0 < r.prefix_cache_hit_rate < 1
    assert r.draft_tokens_scheduled > 0 and r.generated_tokens > SHORT
    assert r.steps > 0 and r.requests_per_s > 0 and r.wall_s > 0
    assert len(r.rss_samples) >= 2 and r.rss_warmup_bytes > 0 and r.rss_end_bytes > 0
    assert abs(r.rss_growth_pct) < r.config["max_rss_growth_pct"]


def test_cli_short_run_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "new" / "soak.json"  # its folder is made
    argv = ["soak", "--num-requests", "3000", "--method", "eagle", "-k", "3"]
    assert cli.main([*argv, "--policy", "priority", "--json", str(path), "--quiet"]) == 0
    report = json.loads(path.read_text())
    assert report["ok"] is True
    assert report["requests_finished"] == report["finished_ids_reported"] == 3000
    assert report["leaked_blocks"] == 0 and report["violations"] == 0
    assert report["config"]["method"] == "eagle" and report["config"]["policy"] == "priority"
    assert report["environment"]["dflash_rs"]


@pytest.mark.parametrize("policy", ["legacy-k", "legacy-first-prefill"])
def test_legacy_lookahead_policy_fails_the_soak(
    policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The soak's checks can fail: a legacy lookahead policy (DFlash) is reported and exits 1."""
    argv = ["soak", "--num-requests", "2000", "--lookahead-policy", policy]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "ownership:" in out and "needs" in out
    assert out.rstrip().splitlines()[-1].startswith("FAILED:") and "violations" in out


def test_subprocess_quiet_prints_the_verdict() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dflash_rs", "soak", "--num-requests", "1000", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "OK: no leak, no violation, RSS flat"


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--num-blocks", "4"], "cannot hold one request"),
        (["--abort-rate", "2"], "argument --abort-rate"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(["soak", *argv])
        assert exc.value.code == 2
        assert message in capsys.readouterr().err


def test_lookahead_table_and_rss() -> None:
    assert [required_lookahead(m, 3) for m in ("dflash", "eagle", "ngram", "none")] == [4, 3, 0, 0]
    assert rss_bytes() > 0


def test_cheap_ownership_check_flags_corrupted_tables() -> None:
    """Each branch of the per-step numpy check fires on a corrupted copy of a real step."""
    config = SoakConfig(num_requests=2, num_blocks=80, block_size=4, method="dflash")
    sched = Scheduler(config.scheduler_config())
    sched.add_request(Request("a", list(range(10)), 8))
    sched.add_request(Request("b", list(range(100, 106)), 8))
    out = sched.schedule()
    check = OwnershipCheck(config, required_lookahead("dflash", config.k))
    assert check.cheap(out, 2) == []
    assert check.full(sched, out, list(out.req_ids)) == []

    def corrupt(change: Callable[[np.ndarray, np.ndarray], None]) -> SimpleNamespace:
        copy = SimpleNamespace(
            req_ids=list(out.req_ids),
            block_table=np.array(out.block_table, copy=True),
            num_blocks_per_row=np.array(out.num_blocks_per_row, copy=True),
            num_computed_tokens=out.num_computed_tokens,
            num_scheduled_tokens_array=out.num_scheduled_tokens_array,
        )
        change(copy.block_table, copy.num_blocks_per_row)
        return copy

    def short(t: np.ndarray, c: np.ndarray) -> None:
        c[0] -= 1

    def null(t: np.ndarray, c: np.ndarray) -> None:
        t[0, 0] = 0

    def stale(t: np.ndarray, c: np.ndarray) -> None:
        t[1, c[1]] = 7

    def shared(t: np.ndarray, c: np.ndarray) -> None:
        t[1, 0] = t[0, c[0] - 1]  # row 0's last (lookahead) block, also in row 1

    for change, fragment in [
        (short, "needs"),
        (null, "invalid block id"),
        (stale, "stale ids"),
        (shared, "lookahead block of"),
    ]:
        problems = check.cheap(corrupt(change), 2)
        assert problems and fragment in problems[0], (change.__name__, problems)
