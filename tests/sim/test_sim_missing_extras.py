"""Without the optional 'sim' extra, `dflash-rs simulate` says what to install (no traceback)."""

from __future__ import annotations

import subprocess
import sys

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
