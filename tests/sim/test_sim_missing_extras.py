"""Without the optional 'sim' extra, `dflash-rs simulate` says what to install (no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import sys
sys.modules["torch"] = None  # as if torch were not installed
from dflash_rs.cli import main
sys.exit(main(["simulate", "--num-requests", "4"]))
"""


def test_simulate_without_torch_names_the_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "pip install 'dflash-rs[sim]'" in done.stderr
    assert "Traceback" not in done.stderr


# The run is replaced by one that exits 99, so a run that starts shows in the exit status.
PLOT_CHILD = """
import sys
sys.modules["matplotlib"] = None  # as if matplotlib were not installed
import dflash_rs.sim.engine as engine
def started(*args, **kwargs):
    print("the run started", file=sys.stderr)
    sys.exit(99)
engine.run_simulation = started
from dflash_rs.cli import main
sys.exit(main(["simulate", "--num-requests", "4", "--plot", sys.argv[1], "--json", sys.argv[2]]))
"""


def test_simulate_plot_without_matplotlib_exits_before_the_run(tmp_path: Path) -> None:
    plot, report = tmp_path / "sim.png", tmp_path / "sim.json"
    done = subprocess.run(
        [sys.executable, "-c", PLOT_CHILD, str(plot), str(report)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "(matplotlib is missing)" in done.stderr
    assert "pip install 'dflash-rs[sim]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert "the run started" not in done.stderr
    assert done.stdout == ""
    assert not plot.exists() and not report.exists()
