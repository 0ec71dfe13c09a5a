"""Memory readings for the soak's growth check: process RSS and the traced Python heap."""

from __future__ import annotations

import os
import tracemalloc
from typing import Optional

__all__ = ["python_heap", "rss_bytes"]


def rss_bytes() -> int:
    """Resident set size of this process (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def python_heap() -> Optional[int]:
    """Bytes traced by tracemalloc (None when it is not tracing)."""
    return tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else None
