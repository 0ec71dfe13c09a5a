"""Runs the typed README loop (``readme_loop.py``; ``make lint`` type-checks it)."""

from __future__ import annotations

from types import MappingProxyType

from .readme_loop import serve


def test_readme_loop_serves_every_request_to_its_length() -> None:
    assert serve({"r1": list(range(40)), "r2": list(range(100, 117))}) == {
        "r1": "length",
        "r2": "length",
    }


def test_readme_loop_takes_any_mapping_of_prompts() -> None:
    assert serve(MappingProxyType({"only": list(range(3))}), k=2) == {"only": "length"}
