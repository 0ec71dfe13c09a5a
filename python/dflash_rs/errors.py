"""Exceptions raised by dflash-rs.

Every error derives from :class:`DFlashRsError`, and also from the builtin a caller would catch
(``ValueError``, ``KeyError``, ``RuntimeError``, ``TypeError``), so ``except ValueError`` keeps
working. An argument of the wrong type raises :class:`ArgumentTypeError`, which is both an
:class:`InvalidArgumentError` and a ``TypeError``.
A failed call leaves every structure as it was.
"""

from __future__ import annotations

__all__ = [
    "ArgumentTypeError",
    "DFlashRsError",
    "DuplicateRequestError",
    "InvalidArgumentError",
    "InvariantError",
    "OutOfBlocksError",
    "PromptTooLongError",
    "SchedulerStateError",
    "UnknownRequestError",
    "UnsupportedFeatureError",
]


class DFlashRsError(Exception):
    """Base class of every dflash-rs error."""


class InvalidArgumentError(DFlashRsError, ValueError):
    """An argument is out of range or inconsistent with the others."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a str where an int is expected, a bool where a token id
    is, a float array where an integer array is). ``except TypeError`` catches it too."""


class UnknownRequestError(DFlashRsError, KeyError):
    """A request id is not known."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class DuplicateRequestError(DFlashRsError, ValueError):
    """A request id is already in use."""


class PromptTooLongError(DFlashRsError, ValueError):
    """A prompt or sequence does not fit ``max_model_len``."""


class OutOfBlocksError(DFlashRsError, RuntimeError):
    """The block pool cannot serve a request that must be served."""


class SchedulerStateError(DFlashRsError, RuntimeError):
    """A call does not fit the current state (e.g. a model output applied twice)."""


class InvariantError(DFlashRsError, AssertionError):
    """An internal invariant is broken: a bug in dflash-rs. Please report it."""


class UnsupportedFeatureError(DFlashRsError, NotImplementedError):
    """A configuration asks for a feature dflash-rs does not implement (yet), e.g. a vLLM KV
    connector. Raised when the object is built, never silently ignored."""
