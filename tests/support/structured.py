"""Whether a structured-output completion matches its constraint (shared by the scheduler-level
structured trace of tests/vllm and the real-engine structured tests of tests/engine)."""

from __future__ import annotations

import json
import re
from typing import Any


def satisfies(kind: str, constraint: Any, text: str) -> bool:
    """Whether ``text`` is a full match of the ``kind`` constraint: one of the ``choice``
    strings, a full match of the ``regex``, or (``json``) an object with exactly the schema's
    properties, each of its type (enums: one of their values; integers: within their bounds)."""
    if kind == "choice":
        return text in constraint
    if kind == "regex":
        return re.fullmatch(constraint, text) is not None
    value = json.loads(text)
    props = constraint["properties"]
    return (
        isinstance(value, dict)
        and set(value) == set(props)
        and all(_matches(value[name], prop) for name, prop in props.items())
    )


def _matches(value: Any, prop: dict[str, Any]) -> bool:
    if "enum" in prop:
        return value in prop["enum"]
    if prop["type"] == "boolean":
        return isinstance(value, bool)
    if prop["type"] == "integer":
        return isinstance(value, int) and prop.get("minimum", value) <= value <= prop.get(
            "maximum", value
        )
    raise ValueError(f"no check for the schema property {prop}")
