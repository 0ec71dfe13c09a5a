"""Option types of the ``dflash-rs`` subcommands: argparse ``type=`` callables that refuse a bad
value with :class:`argparse.ArgumentTypeError`, which argparse reports as a usage error naming
the option (exit status 2), and the help formatter all subcommands share."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable, List, Optional, Sequence

from dflash_rs.errors import DFlashRsError

__all__ = [
    "HelpFormatter",
    "check_or_exit",
    "choice_list",
    "float_in",
    "int_at_least",
    "int_list",
    "non_negative_float",
    "non_negative_int",
    "output_path",
    "positive_float",
    "positive_int",
    "probability",
    "seed",
    "speculative_tokens",
    "string_pair",
]

#: Most speculative tokens per step that :class:`dflash_rs.SpeculativeConfig` accepts.
MAX_SPECULATIVE_TOKENS = 64


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default and keeps the description's own line breaks."""


def _parse_int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def int_at_least(minimum: int, maximum: Optional[int] = None) -> Callable[[str], int]:
    """An integer in ``[minimum, maximum]`` (no upper bound when ``maximum`` is None)."""

    def parse(text: str) -> int:
        value = _parse_int(text)
        if value < minimum or (maximum is not None and value > maximum):
            bound = f"in [{minimum}, {maximum}]" if maximum is not None else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be an integer {bound}, got {value}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
#: numpy's generators take non-negative seeds only.
seed = non_negative_int
speculative_tokens = int_at_least(1, MAX_SPECULATIVE_TOKENS)


def float_in(
    low: float, high: float = math.inf, *, low_open: bool = False
) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``); NaN and infinity
    are refused."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        above_low = value > low if low_open else value >= low
        if not (math.isfinite(value) and above_low and value <= high):
            opening = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {opening}{low:g}, {high:g}], got {text}"
            )
        return value

    return parse


probability = float_in(0.0, 1.0)
non_negative_float = float_in(0.0)
positive_float = float_in(0.0, low_open=True)


def _split(text: str) -> List[str]:
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"expected a comma list without empty items, got {text!r}")
    return items


def int_list(minimum: int = 1) -> Callable[[str], List[int]]:
    """A comma list of integers, each at least ``minimum`` (e.g. ``64,256,1024``)."""
    item = int_at_least(minimum)

    def parse(text: str) -> List[int]:
        return [item(part) for part in _split(text)]

    return parse


def choice_list(choices: Sequence[str]) -> Callable[[str], List[str]]:
    """A comma list whose every item is one of ``choices``."""

    def parse(text: str) -> List[str]:
        items = _split(text)
        unknown = [item for item in items if item not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, unknown))}; choose from {', '.join(choices)}"
            )
        return items

    return parse


def string_pair(text: str) -> str:
    """Two non-empty names joined by one comma (``CTL,ACK``), kept as written."""
    parts = text.split(",")
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected two names separated by a comma, got {text!r}")
    return text


def output_path(text: str) -> str:
    """A file the run can write when it ends: not a folder, and its nearest existing folder is
    writable (missing folders are created at write time, not here)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    path = os.path.abspath(text)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {parent!r} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot create {text!r}: {parent!r} is not writable")
    return text


def check_or_exit(
    parser: argparse.ArgumentParser,
    check: Callable[[argparse.Namespace], object],
    args: argparse.Namespace,
) -> None:
    """Run a subcommand's checks of its options against each other (and against the configs
    they build); a refusal becomes ``parser``'s usage error, exit status 2."""
    try:
        check(args)
    except (ValueError, DFlashRsError) as exc:
        parser.error(str(exc))
