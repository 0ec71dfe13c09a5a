"""Token ids in exact lists are read from the objects' memory (``seq_items``: a list's items in
place; ``compact_int``: an int of one 30-bit digit without a call), after a check that this
interpreter lays them out as expected. These tests pin that the checks pass on every CPython
the wheel supports, and that the in-place read gives exactly what the general read (int
subclasses in a tuple, item by item through the API) gives, accepted or refused, for values on
every side of a digit's and the token range's edges."""

from __future__ import annotations

import sys
from typing import Any, List

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_rs import ArgumentTypeError, InvalidArgumentError, ModelRunnerOutput, Request, Scheduler
from dflash_rs._core import _fast_paths

from .drivers import make_scheduler

K = 3
EDGES = [0, 1, 2, 255, 256, 2**15, 2**30 - 1, 2**30, 2**30 + 1, 2**31 - 1, 2**31, 2**32]
EDGES += [2**60, 2**63 - 1, 2**63, 2**64, 2**90, -1, -2, -(2**30), -(2**31), -(2**64)]


class Token(int):
    """An int subclass: read through the API, never in place."""


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="CPython's layout")
def test_the_in_place_reads_are_enabled_on_this_cpython() -> None:
    encoding, items_in_place = _fast_paths()
    assert encoding == ("signed-size" if sys.version_info < (3, 12) else "tagged")
    assert items_in_place


def _scheduler() -> Scheduler:
    s = make_scheduler(64, method="dflash", k=K, max_num_seqs=4, max_num_batched_tokens=256)
    s.add_request(Request("r", [5] * 8, max_tokens=100))
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput(out.req_ids, [[6]]))
    return s


def _outcome(call: Any) -> Any:
    """What a call gave: ("ok", result) or (exception type, message)."""
    try:
        return ("ok", call())
    except (InvalidArgumentError, ArgumentTypeError) as e:
        return (type(e), str(e))


def _sampled_outcome(tokens: Any) -> Any:
    s = _scheduler()
    out = s.schedule()
    got = _outcome(lambda: s.update_from_output(out, ModelRunnerOutput(out.req_ids, [tokens])))
    if got[0] == "ok":
        got = ("ok", [o.new_token_ids for o in got[1]])
    s.check_invariants()
    return got


def _drafts_outcome(drafts: Any) -> Any:
    s = _scheduler()
    got = _outcome(lambda: s.update_draft_token_ids({"r": drafts}))
    if got[0] == "ok":
        got = ("ok", s.schedule().scheduled_spec_decode_tokens)
    s.check_invariants()
    return got


values = st.one_of(st.sampled_from(EDGES), st.integers(-(2**70), 2**70))


@settings(max_examples=300, deadline=None)
@given(token=values)
def test_in_place_and_general_reads_of_sampled_tokens_agree(token: int) -> None:
    fast = _sampled_outcome([token])
    assert fast == _sampled_outcome((Token(token),))
    if 0 <= token < 2**31:
        assert fast == ("ok", [[token]])
    else:
        assert fast[0] is InvalidArgumentError


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(values, min_size=1, max_size=K))
def test_in_place_and_general_reads_of_drafts_agree(tokens: List[int]) -> None:
    fast = _drafts_outcome(list(tokens))
    general = _drafts_outcome(tuple(Token(t) for t in tokens))
    assert fast == general
    in_range = all(0 <= t < 2**31 for t in tokens)
    assert (fast[0] == "ok") == in_range
    if in_range:
        assert fast[1] == {"r": list(tokens)}
