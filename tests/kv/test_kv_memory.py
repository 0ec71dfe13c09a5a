"""A pool too large for the memory available raises an exception instead of aborting."""

from __future__ import annotations

import gc
import resource
import subprocess
import sys
import weakref

import dflash_rs

CHILD = """
import dflash_rs
try:
    dflash_rs.KVCacheManager(10**8, 16, 1024)
except dflash_rs.InvalidArgumentError as e:
    print("raised:", e)
"""


def _limit_address_space() -> None:
    limit = 3 * 1024**3
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_oversized_pool_raises_instead_of_aborting() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        preexec_fn=_limit_address_space,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "raised: cannot allocate" in done.stdout
    assert "out of memory" in done.stdout


def test_manager_is_weakly_referenceable() -> None:
    """The manager holds no Python object, so no cycle can run through it; a weak reference
    dies with the last strong one."""
    manager = dflash_rs.KVCacheManager(11, 4, 64)
    manager.add_request("a", [1, 2, 3])
    ref = weakref.ref(manager)
    assert ref() is manager
    del manager
    assert ref() is None
    gc.collect()
    assert ref() is None
