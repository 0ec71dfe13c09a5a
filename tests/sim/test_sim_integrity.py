"""The simulation's verdicts: clean under the correct lookahead policy, corrupt under the legacy
ones and under faults injected on purpose (which shows the verifier can fail)."""

from __future__ import annotations

import importlib.util

import pytest

from dflash_rs.sim.engine import run_simulation
from dflash_rs.sim.faults import AliasBlockTable, StrayWrite
from dflash_rs.sim.metrics import SimResult

from .helpers import SMALL, small_config


def test_correct_policy_keeps_kv_integrity_under_preemption(correct_run: SimResult) -> None:
    r = correct_run
    assert r.error is None, r.error
    assert r.ok, r.violations
    assert r.requests_finished == r.requests_submitted == SMALL["num_requests"]
    assert r.integrity_violations == r.ownership_violations == 0
    assert r.invariant_checks > 0 and r.invariant_failures == 0
    # The workload exercised what the verifier must survive.
    assert r.preemptions > 0 and r.resumed > 0
    assert r.prefix_hit_rate > 0.1
    assert 0.0 < r.acceptance_rate < 1.0
    assert r.kv_usage_max > 0.9
    assert r.slots_checked > 100_000


@pytest.mark.parametrize("policy", ["legacy-first-prefill", "legacy-k"])
def test_legacy_lookahead_policies_corrupt_kv(policy: str) -> None:
    r = run_simulation(small_config(lookahead_policy=policy))
    assert r.error is None, r.error
    assert not r.ok
    # Drafter queries past the row's blocks hit the shared null block: the strict kernel counts
    # them, the verifier sees the foreign writes and reads back other requests' draft KV.
    assert r.ownership_violations > 0
    assert r.verifier_counts["foreign_writes"] == r.ownership_violations
    assert r.verifier_counts["readback_query"] > 0
    assert r.integrity_violations > r.ownership_violations
    assert any("null block" in v.detail for v in r.violations)


def test_aliased_block_table_is_caught() -> None:
    fault = AliasBlockTable(block_size=16, step=20)
    r = run_simulation(small_config(), fault=fault)
    assert fault.fired_at is not None
    counts = r.verifier_counts
    assert counts["readback_target"] > 0  # both requests read values that are not theirs
    assert counts["foreign_writes"] > 0
    assert counts["table_mismatches"] == 1
    assert not r.ok


def test_stray_write_is_caught_by_read_back_alone() -> None:
    fault = StrayWrite(step=10)
    r = run_simulation(small_config(), fault=fault)
    assert fault.fired_at is not None
    counts = r.verifier_counts
    assert counts["readback_target"] >= 1
    assert counts["foreign_writes"] == 0 and r.ownership_violations == 0
    assert r.integrity_violations == counts["readback_target"]
    assert not r.ok


@pytest.mark.parametrize(
    "overrides",
    [
        dict(method="none"),
        dict(method="eagle", num_speculative_tokens=3),
        dict(method="ngram"),
        dict(policy="priority", arrival_rate=2.0),
        dict(enable_prefix_caching=False),
        dict(max_model_len=256, num_blocks=60),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_other_settings_keep_kv_integrity(overrides: dict) -> None:
    r = run_simulation(small_config(num_requests=24, **overrides))
    assert r.error is None, r.error
    assert r.ok, r.violations
    assert r.requests_finished == r.requests_submitted == 24


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_triton_kernel_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton kernel (compiled on CUDA, interpreted on CPU) inside the loop."""
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    r = run_simulation(
        small_config(
            num_requests=3, num_blocks=40, max_model_len=512, acceptance_rate=0.95, kernel="triton"
        )
    )
    assert r.error is None, r.error
    assert r.verifier_counts["kernel_mismatches"] == 0
    assert r.ok, r.violations


def test_runs_are_deterministic(correct_run: SimResult) -> None:
    again = run_simulation(small_config())
    assert again.steps == correct_run.steps
    assert again.generated_tokens == correct_run.generated_tokens
    assert again.scheduler_stats["num_preemptions"] == correct_run.preemptions
