"""Test-session setup shared by every test module.

Triton kernels run under the interpreter when no CUDA GPU is present; the variable must be set
before triton is first imported, so it is set here, at collection start.

``slow``-marked tests are skipped unless the marker expression names them: ``pytest tests/kv``
stays fast (about half a minute) and ``pytest tests/kv -m slow`` runs the long model-based test;
likewise ``tests/bench`` (the side-by-side replay on vLLM's scheduler, whose import alone takes
10-20 s) and ``tests/scheduler`` (the long ownership property). ``tests/engine`` is exempt: all
of it is slow, and ``make test-engine`` runs it in its own venv without ``-m``.

This file also puts ``tests/`` on ``sys.path`` (see ``support/__init__.py``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List

import pytest

_ALWAYS_RUN_SLOW = Path(__file__).parent / "engine"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: List[pytest.Item]) -> None:
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="slow: select with -m slow")
    for item in items:
        if "slow" in item.keywords and _ALWAYS_RUN_SLOW not in item.path.parents:
            item.add_marker(skip)
