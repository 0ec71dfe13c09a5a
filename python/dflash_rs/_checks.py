"""Argument checks shared by the Python classes (``config``, ``request``)."""

from __future__ import annotations

import operator
from typing import Optional

from dflash_rs.errors import ArgumentTypeError, InvalidArgumentError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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


def checked_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int in ``[minimum, 2**63 - 1]`` (the scheduler stores 64-bit values):
    ``ArgumentTypeError`` when it is no int, ``InvalidArgumentError`` when out of range."""
    checked = as_int(value)
    if checked is None:
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
    if checked < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {checked}")
    if checked > INT64_MAX:
        raise InvalidArgumentError(f"{name} must be <= 2**63 - 1, got {checked}")
    return checked
