"""Argument checks shared by the Python classes (``config``, ``request``)."""

from __future__ import annotations

import operator
from typing import Optional


def as_int(value: object) -> Optional[int]:
    """``value`` as an int if it is one: an ``int`` or anything with ``__index__`` (numpy
    integers), but not a ``bool`` or ``numpy.bool_``; None otherwise."""
    if isinstance(value, bool) or (
        type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    ):
        return None
    try:
        return operator.index(value)  # type: ignore[call-overload]
    except TypeError:
        return None
