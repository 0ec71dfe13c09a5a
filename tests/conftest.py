"""Test-session setup shared by every test module.

Triton kernels run under the interpreter when no CUDA GPU is present; the variable must be set
before triton is first imported, so it is set here, at collection start.
"""

from __future__ import annotations

import os


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
