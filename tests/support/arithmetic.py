"""Integer arithmetic that the expected block counts of several suites are written in."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (``b > 0``)."""
    return -(-a // b)
