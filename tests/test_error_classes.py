"""The native module resolves its exception classes once, at import.

A class renamed or moved in ``dflash_rs/errors.py`` must fail ``import dflash_rs`` with its
name, not turn every later error of that kind into a bare ``RuntimeError``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import dflash_rs
from dflash_rs import errors

#: Replaces dflash_rs.errors by a copy with one class removed or replaced, then imports the
#: package (whose first import loads the native module).
_PROBE = textwrap.dedent(
    """
    import importlib.util, os, sys, types
    package = importlib.util.find_spec("dflash_rs")  # found, not imported
    path = os.path.join(package.submodule_search_locations[0], "errors.py")
    fake = types.ModuleType("dflash_rs.errors")
    exec(compile(open(path).read(), path, "exec"), fake.__dict__)
    name, action = sys.argv[1], sys.argv[2]
    if action == "remove":
        delattr(fake, name)
    elif action == "replace":
        setattr(fake, name, type(name, (ValueError,), {}))
    sys.modules["dflash_rs.errors"] = fake
    try:
        import dflash_rs
    except ImportError as e:
        print("ImportError:", e)
    else:
        print("imported")
    """
)

#: Every class the native module raises.
NATIVE_CLASSES = [
    "InvalidArgumentError",
    "ArgumentTypeError",
    "UnknownRequestError",
    "DuplicateRequestError",
    "PromptTooLongError",
    "OutOfBlocksError",
    "SchedulerStateError",
    "InvariantError",
]


def _probe(name: str, action: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, name, action],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


@pytest.mark.parametrize("name", NATIVE_CLASSES)
def test_missing_class_fails_the_import(name: str) -> None:
    assert _probe(name, "remove") == (
        f"ImportError: dflash_rs._core: dflash_rs.errors.{name} is missing or not a class "
        f"(AttributeError: module 'dflash_rs.errors' has no attribute '{name}')"
    )


def test_class_outside_the_hierarchy_fails_the_import() -> None:
    assert _probe("OutOfBlocksError", "replace") == (
        "ImportError: dflash_rs._core: dflash_rs.errors.OutOfBlocksError is not a DFlashRsError"
    )


def test_intact_module_imports() -> None:
    assert _probe("DFlashRsError", "keep") == "imported"


def test_native_errors_are_the_package_classes() -> None:
    """The classes resolved at import are the ones callers catch (not copies)."""
    scheduler = dflash_rs.Scheduler(dflash_rs.SchedulerConfig(num_blocks=600, block_size=16))
    scheduler.add_request(dflash_rs.Request("a", [5] * 10, 4))
    with pytest.raises(errors.DuplicateRequestError):
        scheduler.add_request(dflash_rs.Request("a", [5] * 10, 4))
    out = scheduler.schedule()
    with pytest.raises(errors.InvalidArgumentError, match="req_ids"):
        scheduler.update_from_output(out, dflash_rs.ModelRunnerOutput(["x"], [[1]]))
