"""The report: documented JSON keys, a real PNG, a readable summary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dflash_rs.sim.metrics import SimResult
from dflash_rs.sim.report import JSON_KEYS, summary, to_json, write_json, write_plot

#: The keys the issue asks for; JSON_KEYS documents more.
REQUIRED_KEYS = {
    "steps": int,
    "requests_finished": int,
    "integrity_violations": int,
    "sched_step_us_p50": float,
    "sched_step_us_p99": float,
    "preemptions": int,
    "prefix_hit_rate": float,
    "acceptance_rate": float,
    "kv_usage_max": float,
}


def test_json_report_has_the_documented_keys(correct_run: SimResult, tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    write_json(correct_run, path)
    doc = json.loads(path.read_text())
    assert set(REQUIRED_KEYS) <= set(JSON_KEYS)
    assert list(doc)[: len(JSON_KEYS)] == list(JSON_KEYS)
    for key, kind in REQUIRED_KEYS.items():
        assert isinstance(doc[key], kind), (key, doc[key])
    assert doc["ok"] is True and doc["error"] is None
    assert doc["integrity_violations"] == 0 and doc["violations"] == []
    assert doc["steps"] == correct_run.steps > 0
    assert 0 < doc["sched_step_us_p50"] <= doc["sched_step_us_p99"]
    assert doc["config"]["lookahead_policy"] == "correct"
    assert doc == json.loads(json.dumps(to_json(correct_run)))


def test_plot_is_a_real_png(correct_run: SimResult, tmp_path: Path) -> None:
    import matplotlib.image

    path = tmp_path / "run.png"
    write_plot(correct_run, path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[0] >= 600 and pixels.shape[1] >= 800
    assert float(np.std(pixels[..., :3])) > 0.05  # lines and text, not a blank canvas


def test_summary_is_readable(correct_run: SimResult) -> None:
    text = summary(correct_run)
    for word in (
        "requests",
        "scheduler",
        "p50",
        "p99",
        "kv cache",
        "prefix hit rate",
        "preemptions",
        "acceptance",
        "integrity",
        "ownership",
    ):
        assert word in text
    assert text.splitlines()[-1].startswith("OK")
