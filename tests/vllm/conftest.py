"""Fixtures of the vLLM drop-in tests.

They run only where vLLM 0.33 is installed (each module starts with an ``importorskip``):
``scripts/vllm_env.sh`` builds that venv and runs them. Nothing here imports vLLM at
collection time. This directory must not get an ``__init__.py``: it would be imported as a
package named ``vllm`` and shadow the real one.
"""

from __future__ import annotations

import tempfile
from typing import Any, Iterator

import pytest


@pytest.fixture(scope="session")
def offline() -> Iterator[Any]:
    """Factory of offline vLLM configs and requests (tiny config.json-only models)."""
    from dflash_rs.bench.offline_vllm import OfflineVllm

    with tempfile.TemporaryDirectory(prefix="dflash-rs-vllm-") as root:
        yield OfflineVllm(root)


@pytest.fixture
def make_scheduler(offline: Any) -> Any:
    """``make_scheduler(**configs_kwargs, log_stats=True, cls=DFlashRsScheduler)``."""
    from dflash_rs.vllm import DFlashRsScheduler

    def make(cls: type = DFlashRsScheduler, log_stats: bool = True, **kwargs: Any) -> Any:
        kwargs.setdefault("num_blocks", 64)
        cfg, kv = offline.configs(**kwargs)
        return offline.scheduler(cls, cfg, kv, log_stats=log_stats)

    return make


@pytest.fixture
def scheduler(make_scheduler: Any) -> Any:
    return make_scheduler()
