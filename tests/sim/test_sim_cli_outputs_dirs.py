"""Report paths in folders that do not exist yet are created (the README's `make sim` writes to
out/, which a fresh clone lacks)."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_rs.cli import main


def test_json_and_plot_create_their_folders(tmp_path: Path) -> None:
    json_path = tmp_path / "new" / "deeper" / "report.json"
    plot_path = tmp_path / "other" / "plot.png"
    code = main(
        [
            "simulate",
            "--num-requests",
            "12",
            "--num-blocks",
            "400",
            "--quiet",
            "--json",
            str(json_path),
            "--plot",
            str(plot_path),
        ]
    )
    assert code == 0
    assert json.loads(json_path.read_text())["integrity_violations"] == 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
