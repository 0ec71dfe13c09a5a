"""Skip the ``slow``-marked tests of this directory unless the marker expression asks for them.

``pytest tests/bench`` stays fast (a few seconds); ``pytest tests/bench -m slow`` also runs the
side-by-side test that replays the workload on vLLM's scheduler (vLLM's import alone takes
10-20 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: select with -m slow")
    for item in items:
        if "slow" in item.keywords and _HERE in item.path.parents:
            item.add_marker(skip)
