"""Bad request input (fields of ``Request`` and duck requests, prompts, token ids, request ids
in lookups and finish_requests, argument types) raises a typed error and changes nothing; the
integer types and array dtypes that are accepted. The shared pieces are in bad_input.py."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable, Dict

import numpy as np
import pytest

from dflash_rs import (
    ArgumentTypeError,
    DFlashRsError,
    DuplicateRequestError,
    InvalidArgumentError,
    ModelRunnerOutput,
    OutOfBlocksError,
    PromptTooLongError,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SpeculativeConfig,
    UnknownRequestError,
)

from .bad_input import (
    MML,
    Case,
    check_bad_input,
    duck_config,
    duck_request,
    good_output,
    populated,
    snapshot,
)
from .drivers import make_scheduler

#: Bad request fields (overrides of ``duck_request()``): ``Request(...)`` and submitting a duck
#: request raise the same error with the same message, from the one validator.
REQUEST_FIELD_CASES: Dict[str, Dict[str, Any]] = {
    "empty id": {"request_id": ""},
    "id an int": {"request_id": 5},
    "max_tokens 0": {"max_tokens": 0},
    "max_tokens negative": {"max_tokens": -1},
    "max_tokens a bool": {"max_tokens": True},
    "max_tokens a float": {"max_tokens": 4.0},
    "max_tokens huge": {"max_tokens": 2**70},
    "min_tokens negative": {"min_tokens": -1},
    "min_tokens above max_tokens": {"min_tokens": 5},
    "priority a str": {"priority": "high"},
    "eos_token_id negative": {"eos_token_id": -1},
    "eos_token_id past int32": {"eos_token_id": 2**31},
    "stop_token_ids a str": {"stop_token_ids": "ab"},
    "stop_token_ids None": {"stop_token_ids": None},
    "stop token negative": {"stop_token_ids": [3, -2]},
    "ignore_eos a str": {"ignore_eos": "yes"},
    "arrival_time a str": {"arrival_time": "now"},
    "arrival_time infinite": {"arrival_time": float("inf")},
    "lora_name an int": {"lora_name": 5},
    "cache_salt bytes": {"cache_salt": b"salt"},
    "lora_id 0": {"lora_id": 0},
    "skip_reading_prefix_cache an int": {"skip_reading_prefix_cache": 1},
}


@pytest.mark.parametrize("name", list(REQUEST_FIELD_CASES))
def test_bad_request_field_raises_one_error_built_or_submitted(name: str) -> None:
    fields = {**vars(duck_request()), **REQUEST_FIELD_CASES[name]}
    with pytest.raises(DFlashRsError) as built:
        Request(**fields)
    sched, _ = populated()
    before = snapshot(sched)
    with pytest.raises(DFlashRsError) as submitted:
        sched.add_request(SimpleNamespace(**fields))
    assert type(built.value) is type(submitted.value)
    assert str(built.value) == str(submitted.value)
    assert snapshot(sched) == before


#: Bad requests and bad request ids, each raising on ``populated()``'s scheduler.
REQUEST_CASES: Dict[str, Case] = {
    # ---- add_request
    "duplicate id (running)": Case(
        lambda s, o: s.add_request(Request("run", [1, 2], 4)),
        DuplicateRequestError,
        'request id "run" is already in use',
    ),
    "duplicate id (waiting)": Case(
        lambda s, o: s.add_request(Request("wait", [1, 2], 4)),
        DuplicateRequestError,
        "already in use",
    ),
    "empty id (Request)": Case(
        lambda s, o: s.add_request(Request("", [1, 2], 4)),
        InvalidArgumentError,
        "request_id must be a non-empty string",
    ),
    "empty id (duck)": Case(
        lambda s, o: s.add_request(duck_request(request_id="")),
        InvalidArgumentError,
        "request_id must be a non-empty string",
    ),
    "id not a str (duck)": Case(
        lambda s, o: s.add_request(duck_request(request_id=5)),
        ArgumentTypeError,
        "request_id must be a str, got int",
    ),
    "empty prompt": Case(
        lambda s, o: s.add_request(Request("e", [], 4)),
        InvalidArgumentError,
        "prompt_token_ids must not be empty",
    ),
    "empty prompt array": Case(
        lambda s, o: s.add_request(Request("e", np.array([], dtype=np.int32), 4)),
        InvalidArgumentError,
        "must not be empty",
    ),
    "prompt longer than max_model_len": Case(
        lambda s, o: s.add_request(Request("long", [1] * (MML + 1), 4)),
        PromptTooLongError,
        f"prompt of {MML + 1} tokens exceeds max_model_len {MML}",
    ),
    "max_tokens 0 (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], 0)),
        InvalidArgumentError,
        "max_tokens must be >= 1",
    ),
    "max_tokens 0 (duck)": Case(
        lambda s, o: s.add_request(duck_request(max_tokens=0)),
        InvalidArgumentError,
        "max_tokens must be >= 1",
    ),
    "max_tokens negative (duck)": Case(
        lambda s, o: s.add_request(duck_request(max_tokens=-1)),
        InvalidArgumentError,
        "max_tokens must be >= 1, got -1",
    ),
    "min_tokens negative (duck)": Case(
        lambda s, o: s.add_request(duck_request(min_tokens=-1)),
        InvalidArgumentError,
        "min_tokens must be >= 0",
    ),
    "token id 2**31": Case(
        lambda s, o: s.add_request(Request("t", [1, 2**31], 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = 2147483648 is outside [0, 2**31 - 1]",
    ),
    "token id 2**40": Case(
        lambda s, o: s.add_request(Request("t", [2**40], 4)),
        InvalidArgumentError,
        "is outside [0, 2**31 - 1]",
    ),
    "negative token id": Case(
        lambda s, o: s.add_request(Request("t", [3, -1], 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = -1 is outside",
    ),
    "int64 array out of int32": Case(
        lambda s, o: s.add_request(Request("t", np.array([2**31], dtype=np.int64), 4)),
        InvalidArgumentError,
        "prompt_token_ids[0] = 2147483648 is outside",
    ),
    "negative int32 array": Case(
        lambda s, o: s.add_request(Request("t", np.array([1, -5], dtype=np.int32), 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = -5 is outside",
    ),
    "eos out of range (Request)": Case(
        lambda s, o: s.add_request(Request("t", [1], 4, eos_token_id=2**31)),
        InvalidArgumentError,
        "eos_token_id = 2147483648 is outside",
    ),
    "eos negative (duck)": Case(
        lambda s, o: s.add_request(duck_request(eos_token_id=-1)),
        InvalidArgumentError,
        "eos_token_id = -1 is outside",
    ),
    "stop token negative (Request)": Case(
        lambda s, o: s.add_request(Request("t", [1], 4, stop_token_ids=[-2])),
        InvalidArgumentError,
        "is outside [0, 2**31 - 1]",
    ),
    "stop token out of range (duck)": Case(
        lambda s, o: s.add_request(duck_request(stop_token_ids=[2**31])),
        InvalidArgumentError,
        "stop_token_ids[0] = 2147483648 is outside",
    ),
    "prompt is a str": Case(
        lambda s, o: s.add_request(duck_request(prompt_token_ids="abc")),
        InvalidArgumentError,
        "must be a sequence of ints, not a string",
    ),
    "prompt of floats": Case(
        lambda s, o: s.add_request(Request("t", [1.5, 2.0], 4)),
        InvalidArgumentError,
        "must be a sequence of ints or a 1-D integer array",
    ),
    "prompt None": Case(
        lambda s, o: s.add_request(duck_request(prompt_token_ids=None)),
        InvalidArgumentError,
        "must be a sequence of ints",
    ),
    "float array prompt": Case(
        lambda s, o: s.add_request(Request("t", np.zeros(3, dtype=np.float32), 4)),
        ArgumentTypeError,
        "prompt_token_ids must be a 1-D integer array, got ndim=1 dtype=float32",
    ),
    "2-D array prompt": Case(
        lambda s, o: s.add_request(Request("t", np.zeros((2, 2), dtype=np.int64), 4)),
        InvalidArgumentError,
        "got ndim=2",
    ),
    "not a request": Case(
        lambda s, o: s.add_request(42),
        InvalidArgumentError,
        'request has no attribute "request_id"',
    ),
    "priority not an int (duck)": Case(
        lambda s, o: s.add_request(duck_request(priority="high")),
        ArgumentTypeError,
        "priority must be an int, got str",
    ),
    "lora_name not a str (duck)": Case(
        lambda s, o: s.add_request(duck_request(lora_name=5)),
        ArgumentTypeError,
        "lora_name must be a str, got int",
    ),
    "arrival_time nan (duck)": Case(
        lambda s, o: s.add_request(duck_request(arrival_time=float("nan"))),
        InvalidArgumentError,
        "arrival_time must be finite",
    ),
    "id not a str (Request)": Case(
        lambda s, o: s.add_request(Request(5, [1, 2], 4)),
        InvalidArgumentError,
        "request_id must be a str, got int",
    ),
    "max_tokens negative (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], -1)),
        InvalidArgumentError,
        "max_tokens must be >= 1, got -1",
    ),
    "max_tokens bool (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], True)),
        InvalidArgumentError,
        "max_tokens must be an int",
    ),
    "max_tokens huge (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], 2**70)),
        InvalidArgumentError,
        "max_tokens = 1180591620717411303424 is out of range",
    ),
    "max_tokens huge (duck)": Case(
        lambda s, o: s.add_request(duck_request(max_tokens=2**70)),
        InvalidArgumentError,
        "max_tokens = 1180591620717411303424 is out of range",
    ),
    "min_tokens negative (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], 4, min_tokens=-1)),
        InvalidArgumentError,
        "min_tokens must be >= 0, got -1",
    ),
    "priority not an int (Request)": Case(
        lambda s, o: s.add_request(Request("p", [1], 4, priority="high")),
        InvalidArgumentError,
        "priority must be an int",
    ),
    "priority huge (Request)": Case(
        lambda s, o: s.add_request(Request("p", [1], 4, priority=2**70)),
        InvalidArgumentError,
        "priority = 1180591620717411303424 is out of range",
    ),
    "priority huge (duck)": Case(
        lambda s, o: s.add_request(duck_request(priority=2**70)),
        InvalidArgumentError,
        "priority = 1180591620717411303424 is out of range",
    ),
    "ignore_eos not a bool (Request)": Case(
        lambda s, o: s.add_request(Request("i", [1], 4, ignore_eos="yes")),
        InvalidArgumentError,
        "ignore_eos must be a bool, got str",
    ),
    "ignore_eos not a bool (duck)": Case(
        lambda s, o: s.add_request(duck_request(ignore_eos="yes")),
        ArgumentTypeError,
        "ignore_eos must be a bool, got str",
    ),
    "arrival_time not a number (Request)": Case(
        lambda s, o: s.add_request(Request("a", [1], 4, arrival_time="now")),
        InvalidArgumentError,
        "arrival_time must be a number or None, got str",
    ),
    "arrival_time not a number (duck)": Case(
        lambda s, o: s.add_request(duck_request(arrival_time="now")),
        ArgumentTypeError,
        "arrival_time must be a number or None, got str",
    ),
    "arrival_time inf (Request)": Case(
        lambda s, o: s.add_request(Request("a", [1], 4, arrival_time=float("inf"))),
        InvalidArgumentError,
        "arrival_time must be finite",
    ),
    "lora_name not a str (Request)": Case(
        lambda s, o: s.add_request(Request("l", [1], 4, lora_name=5)),
        InvalidArgumentError,
        "lora_name must be a str, got int",
    ),
    "cache_salt not a str (Request)": Case(
        lambda s, o: s.add_request(Request("c", [1], 4, cache_salt=b"salt")),
        InvalidArgumentError,
        "cache_salt must be a str, got bytes",
    ),
    "stop_token_ids a str (Request)": Case(
        lambda s, o: s.add_request(Request("t", [1], 4, stop_token_ids="ab")),
        InvalidArgumentError,
        "stop_token_ids must be a sequence of ints, not a string",
    ),
    "eos negative (Request)": Case(
        lambda s, o: s.add_request(Request("t", [1], 4, eos_token_id=-1)),
        InvalidArgumentError,
        "eos_token_id = -1 is outside",
    ),
    "prompt None (Request)": Case(
        lambda s, o: s.add_request(Request("t", None, 4)),
        InvalidArgumentError,
        "must be a sequence of ints",
    ),
    "duplicate id (running, scheduled in the pending step)": Case(
        lambda s, o: s.add_request(Request("run2", [1], 4)),
        DuplicateRequestError,
        'request id "run2" is already in use',
    ),
    "min_tokens above max_tokens (duck)": Case(
        lambda s, o: s.add_request(duck_request(min_tokens=5, max_tokens=4)),
        InvalidArgumentError,
        "min_tokens (5) must be <= max_tokens (4)",
    ),
    # ---- finishing, lookups
    "finish: a list of ints": Case(
        lambda s, o: s.finish_requests([1, 2]),
        ArgumentTypeError,
        "request_ids must be a str or an iterable of str",
    ),
    "finish: unknown status": Case(
        lambda s, o: s.finish_requests(["run"], status="bogus"),
        InvalidArgumentError,
        'unknown finish status "bogus"',
    ),
    "finish: ids not strings": Case(
        lambda s, o: s.finish_requests(123),
        ArgumentTypeError,
        "request_ids must be a str or an iterable of str",
    ),
    "block_ids of an unknown id": Case(
        lambda s, o: s.block_ids("nope"),
        UnknownRequestError,
        'unknown request id "nope"',
    ),
    "num_computed_tokens of an unknown id": Case(
        lambda s, o: s.num_computed_tokens("nope"), KeyError, "unknown request id"
    ),
    "all_token_ids of an unknown id": Case(
        lambda s, o: s.all_token_ids("nope"), KeyError, "unknown request id"
    ),
    "request_status of an unknown id": Case(
        lambda s, o: s.request_status("nope"), UnknownRequestError, "unknown request id"
    ),
    # ---- bools are not token ids or counts (bool is an int subclass; numpy.bool_ has no
    # __index__ but must be named as a bool too)
    "prompt of bools": Case(
        lambda s, o: s.add_request(Request("b", [True, False], 4)),
        ArgumentTypeError,
        "prompt_token_ids[0] must be an int, got the bool True",
    ),
    "prompt with a numpy bool": Case(
        lambda s, o: s.add_request(Request("b", [1, np.True_], 4)),
        ArgumentTypeError,
        "prompt_token_ids[1] must be an int, got the bool True",
    ),
    "prompt tuple with a bool (duck)": Case(
        lambda s, o: s.add_request(duck_request(prompt_token_ids=(1, 2, False))),
        ArgumentTypeError,
        "prompt_token_ids[2] must be an int, got the bool False",
    ),
    "prompt bool array": Case(
        lambda s, o: s.add_request(Request("b", np.array([True, False]), 4)),
        ArgumentTypeError,
        "prompt_token_ids must be a 1-D integer array, got ndim=1 dtype=bool",
    ),
    "stop tokens of bools (duck)": Case(
        lambda s, o: s.add_request(duck_request(stop_token_ids=[False])),
        ArgumentTypeError,
        "stop_token_ids[0] must be an int, got the bool False",
    ),
    "stop tokens with a numpy bool (Request)": Case(
        lambda s, o: s.add_request(Request("b", [1], 4, stop_token_ids=[np.False_])),
        ArgumentTypeError,
        "stop_token_ids[0] must be an int, got the bool False",
    ),
    "max_tokens numpy bool (Request)": Case(
        lambda s, o: s.add_request(Request("m", [1], np.True_)),
        ArgumentTypeError,
        "max_tokens must be an int, got the bool True",
    ),
    "max_tokens numpy bool (duck)": Case(
        lambda s, o: s.add_request(duck_request(max_tokens=np.True_)),
        ArgumentTypeError,
        "max_tokens must be an int, got the bool True",
    ),
    "eos bool (duck)": Case(
        lambda s, o: s.add_request(duck_request(eos_token_id=True)),
        ArgumentTypeError,
        "eos_token_id must be an int, got the bool True",
    ),
    "arrival_time bool (duck)": Case(
        lambda s, o: s.add_request(duck_request(arrival_time=True)),
        ArgumentTypeError,
        "arrival_time must be a number or None, got bool",
    ),
    # ---- integer arrays of every dtype: values are range-checked
    "uint64 prompt beyond int32": Case(
        lambda s, o: s.add_request(Request("t", np.array([1, 2**63], dtype=np.uint64), 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = 9223372036854775808 is outside [0, 2**31 - 1]",
    ),
    "uint32 prompt beyond int32": Case(
        lambda s, o: s.add_request(Request("t", np.array([2**31], dtype=np.uint32), 4)),
        InvalidArgumentError,
        "prompt_token_ids[0] = 2147483648 is outside",
    ),
    "negative int8 prompt": Case(
        lambda s, o: s.add_request(Request("t", np.array([4, -1], dtype=np.int8), 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = -1 is outside",
    ),
    "big-endian prompt array": Case(
        lambda s, o: s.add_request(Request("t", np.array([1, 2], dtype=">i8"), 4)),
        InvalidArgumentError,
        "prompt_token_ids must be an integer array in native byte order, got dtype=>i8",
    ),
    "prompt token beyond 64 bits": Case(
        lambda s, o: s.add_request(Request("t", [1, 2**70], 4)),
        InvalidArgumentError,
        "prompt_token_ids[1] = 1180591620717411303424 is outside [0, 2**31 - 1]",
    ),
    # ---- wrong argument types raise ArgumentTypeError (an InvalidArgumentError and a
    # TypeError), not the builtin TypeError of PyO3's argument extraction
    "block_ids of an int id": Case(
        lambda s, o: s.block_ids(5), ArgumentTypeError, "request_id must be a str, got int"
    ),
    "num_computed_tokens of None": Case(
        lambda s, o: s.num_computed_tokens(None),
        ArgumentTypeError,
        "request_id must be a str, got NoneType",
    ),
    "num_output_placeholders of an object": Case(
        lambda s, o: s.num_output_placeholders(object()),
        ArgumentTypeError,
        "request_id must be a str, got object",
    ),
    "all_token_ids of bytes": Case(
        lambda s, o: s.all_token_ids(b"run"),
        ArgumentTypeError,
        "request_id must be a str, got bytes",
    ),
    "request_status of a list": Case(
        lambda s, o: s.request_status(["run"]),
        ArgumentTypeError,
        "request_id must be a str, got list",
    ),
    "has_request of a float": Case(
        lambda s, o: s.has_request(1.5), ArgumentTypeError, "request_id must be a str, got float"
    ),
    "request_id with a lone surrogate": Case(
        lambda s, o: s.block_ids("\ud800"),
        InvalidArgumentError,
        "request_id is not valid text (it holds a lone surrogate)",
    ),
    "finish: status not a str": Case(
        lambda s, o: s.finish_requests(["run"], status=3),
        ArgumentTypeError,
        "a str argument must be a str, got int",
    ),
    "finish: a None among the ids": Case(
        lambda s, o: s.finish_requests(["run", None]),
        ArgumentTypeError,
        "request_ids must be a str or an iterable of str",
    ),
    "stop_token_ids None (Request)": Case(
        lambda s, o: s.add_request(Request("t", [1], 4, stop_token_ids=None)),
        ArgumentTypeError,
        "stop_token_ids must be a sequence of ints or a 1-D integer array, got NoneType",
    ),
    "stop_token_ids an int (duck)": Case(
        lambda s, o: s.add_request(duck_request(stop_token_ids=7)),
        ArgumentTypeError,
        "stop_token_ids must be a sequence of ints or a 1-D integer array, got int",
    ),
    "priority a float (duck)": Case(
        lambda s, o: s.add_request(duck_request(priority=1.5)),
        ArgumentTypeError,
        "priority must be an int, got float",
    ),
    "cache_salt bytes (duck)": Case(
        lambda s, o: s.add_request(duck_request(cache_salt=b"salt")),
        ArgumentTypeError,
        "cache_salt must be a str, got bytes",
    ),
    "request_id not a str (Request)": Case(
        lambda s, o: s.add_request(Request(None, [1], 4)),
        ArgumentTypeError,
        "request_id must be a str, got NoneType",
    ),
}


@pytest.mark.parametrize("name", list(REQUEST_CASES))
def test_bad_input_changes_nothing(name: str) -> None:
    check_bad_input(REQUEST_CASES[name])


def test_error_classes_are_builtin_compatible() -> None:
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(DuplicateRequestError, ValueError)
    assert issubclass(PromptTooLongError, ValueError)
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(SchedulerStateError, RuntimeError)


def test_argument_type_error_is_a_type_error() -> None:
    """Callers catching the builtin TypeError (as for PyO3's own argument errors) keep working."""
    assert issubclass(ArgumentTypeError, InvalidArgumentError)
    assert issubclass(ArgumentTypeError, TypeError)
    sched, _ = populated()
    with pytest.raises(TypeError):
        sched.block_ids(5)
    with pytest.raises(ValueError):
        sched.block_ids(5)


def test_a_finished_id_can_be_reused() -> None:
    sched, out = populated()
    sched.update_from_output(out, good_output(out))
    assert sched.finish_requests(["wait"]) == ["wait"]
    sched.add_request(Request("wait", [9, 9], 4))
    assert sched.waiting_request_ids() == ["wait"]
    sched.check_invariants()


def test_prompt_of_exactly_max_model_len_is_accepted() -> None:
    sched = make_scheduler(24, block_size=4, max_model_len=MML)
    sched.add_request(Request("full", [1] * MML, 4))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"full": MML}
    (result,) = sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[2]]))
    assert result.finish_reason == "length"


def test_prompt_larger_than_the_pool_changes_nothing() -> None:
    """A prompt that needs more blocks than the whole pool is refused at admission, also while
    other requests hold blocks, and the refusal changes nothing. (Only a pool smaller than one
    max_model_len request has such prompts: a default config refuses that pool.)"""
    sched = make_scheduler(6, block_size=4, max_model_len=MML, pool_must_hold_max_model_len=False)
    sched.add_request(Request("small", [1, 2, 3, 4, 5], 8))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[6]]))
    before = snapshot(sched)
    with pytest.raises(OutOfBlocksError, match="needs 6 KV blocks but the pool has only 5"):
        sched.add_request(Request("big", list(range(21)), 4))
    assert snapshot(sched) == before
    sched.check_invariants()
    assert list(sched.schedule().req_ids) == ["small"]


def test_min_tokens_above_max_tokens_is_refused_at_construction() -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape("min_tokens (5) must be <=")):
        Request("r", [1, 2], 4, min_tokens=5)
    assert Request("r", [1, 2], 4, min_tokens=4).min_tokens == 4


_INT_DTYPES = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]


def test_numpy_integer_scalars_are_ints() -> None:
    """Wherever an int goes, a numpy integer scalar is accepted (and stored as an int)."""
    config = SchedulerConfig(
        np.int64(24),
        block_size=np.int32(4),
        max_model_len=np.uint16(MML),
        max_num_seqs=np.uint8(2),
        max_num_batched_tokens=np.int16(64),
        draft_slots_per_request=np.uint32(0),
        speculative=SpeculativeConfig("dflash", np.int8(3)),
    )
    assert type(config.num_blocks) is int and config.num_blocks == 24
    assert type(config.speculative.num_speculative_tokens) is int
    sched = Scheduler(config)
    request = Request(
        "run",
        [np.int32(1), np.uint64(2), 3],
        np.int32(20),
        eos_token_id=np.int64(7),
        stop_token_ids=np.array([8, 9], dtype=np.uint16),
        min_tokens=np.uint8(1),
        priority=np.int16(-3),
    )
    assert [type(v) for v in (request.max_tokens, request.eos_token_id, request.priority)] == [
        int
    ] * 3
    sched.add_request(request)
    # The bindings read a duck request's numpy fields too.
    sched.add_request(
        duck_request(request_id="run2", max_tokens=np.uint32(20), priority=np.int8(1))
    )
    duck = Scheduler(duck_config(num_blocks=np.int64(20), block_size=np.uint8(16)))
    assert duck.num_free_blocks == 19
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"run": 3, "run2": 3}
    sched.update_from_output(out, ModelRunnerOutput(out.req_ids, [[np.int64(4)], [np.uint8(5)]]))
    assert sched.update_draft_token_ids({"run": [np.int32(6), np.uint16(7)]}) == 1
    assert sched.all_token_ids("run") == [1, 2, 3, 4]
    assert sched.schedule().scheduled_spec_decode_tokens == {"run": [6, 7]}
    sched.check_invariants()


@pytest.mark.parametrize("dtype", _INT_DTYPES)
def test_integer_arrays_of_every_dtype(dtype: str) -> None:
    """Prompts, flat sampled tokens with their counts and draft arrays take every integer dtype
    and read the same values as from lists; strided views are read by value."""
    by_array = make_scheduler(24, method="dflash", k=3, block_size=4, max_model_len=MML)
    by_list = make_scheduler(24, method="dflash", k=3, block_size=4, max_model_len=MML)
    prompt = np.arange(20, dtype=dtype)[::2]  # strided: not a contiguous slice
    by_array.add_request(Request("a", prompt, 8, stop_token_ids=np.array([99], dtype=dtype)))
    by_list.add_request(Request("a", prompt.tolist(), 8, stop_token_ids=[99]))
    for sched in (by_array, by_list):
        out = sched.schedule()
        if sched is by_array:
            runner = ModelRunnerOutput.from_arrays(
                out.req_ids, np.array([5], dtype=dtype), np.array([1], dtype=dtype)
            )
        else:
            runner = ModelRunnerOutput(out.req_ids, [[5]])
        sched.update_from_output(out, runner)
    assert by_array.all_token_ids("a") == by_list.all_token_ids("a") == [*range(0, 20, 2), 5]
    out = by_array.schedule()
    assert (
        by_array.update_draft_token_ids_from_arrays(
            out, np.array([1, 2], dtype=dtype), np.array([2], dtype=dtype)
        )
        == 1
    )
    by_array.update_from_output(out, ModelRunnerOutput(out.req_ids, [[6]]))
    assert by_array.schedule().scheduled_spec_decode_tokens == {"a": [1, 2]}
    by_array.check_invariants()


@pytest.mark.parametrize(
    "ids",
    [
        lambda: {"run", "wait"},
        lambda: (i for i in ["run", "wait"]),
        lambda: {"run": 0, "wait": 1}.keys(),
        lambda: ("run", "wait"),
    ],
    ids=["set", "generator", "dict-keys", "tuple"],
)
def test_finish_requests_takes_any_iterable_of_ids(ids: Callable[[], Any]) -> None:
    """As its stub says (``Iterable[str]``): sets, generators and dict views too."""
    sched, _ = populated()
    assert sorted(sched.finish_requests(ids())) == ["run", "wait"]
    assert sched.running_request_ids() == ["run2"] and sched.waiting_request_ids() == []
    sched.check_invariants()


def test_an_error_raised_by_the_ids_iterable_propagates() -> None:
    sched, _ = populated()
    before = snapshot(sched)

    def ids() -> Any:
        yield "run"
        raise LookupError("from the caller's generator")

    with pytest.raises(LookupError, match="caller's generator"):
        sched.finish_requests(ids())
    assert snapshot(sched) == before
