"""Integer arithmetic shared across the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    import numpy as np

__all__ = ["cdiv"]

_Int = TypeVar("_Int", int, "np.ndarray")


def cdiv(a: _Int, b: int) -> _Int:
    """``ceil(a / b)`` in integers, for ``b > 0`` (elementwise for a numpy array ``a``)."""
    return -(-a // b)
