"""Bad input raises a typed error with a useful message and changes nothing.

Most cases run against the same populated scheduler: two running DFlash requests with drafts, a
third waiting behind max_num_seqs, and one scheduled step whose model output is still pending.
Each case compares a snapshot (free blocks, request counts, queues, every request's status,
computed tokens, tokens and blocks, stats) before and after the failing call, runs
check_invariants(), and then applies the pending step's real output, which must still work.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Type

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

from .drivers import make_scheduler

MML = 64


def populated() -> Tuple[Scheduler, Any]:
    sched = make_scheduler(
        24,
        method="dflash",
        k=3,
        block_size=4,
        max_model_len=MML,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    sched.add_request(Request("run", list(range(10)), 20, arrival_time=0.0))
    sched.add_request(Request("run2", list(range(5, 12)), 20, arrival_time=1.0))
    sched.add_request(Request("wait", list(range(30, 40)), 20, arrival_time=2.0))
    out = sched.schedule()
    sched.update_from_output(
        out, ModelRunnerOutput(out.req_ids, [[1], [2]], draft_token_ids=[[3, 4], [5]])
    )
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"run": 3, "run2": 2}
    assert out.scheduled_spec_decode_tokens == {"run": [3, 4], "run2": [5]}
    sched.check_invariants()
    return sched, out


def good_sampled(out: Any) -> List[List[int]]:
    by_id = {"run": [3, 9], "run2": [5, 6]}
    return [by_id[r] for r in out.req_ids]


def good_output(out: Any) -> ModelRunnerOutput:
    return ModelRunnerOutput(list(out.req_ids), good_sampled(out))


def snapshot(sched: Scheduler) -> Dict[str, Any]:
    running = sched.running_request_ids()
    waiting = sched.waiting_request_ids()
    return {
        "free": sched.num_free_blocks,
        "usage": sched.kv_cache_usage,
        "counts": sched.get_request_counts(),
        "unfinished": sched.get_num_unfinished_requests(),
        "running": running,
        "waiting": waiting,
        "stats": dict(sched.stats()),
        "requests": {
            rid: (
                sched.request_status(rid),
                sched.num_computed_tokens(rid),
                sched.all_token_ids(rid),
                sched.block_ids(rid),
            )
            for rid in running + waiting
        },
    }


def duck_request(**overrides: Any) -> SimpleNamespace:
    """An object with Request's attributes that is no ``Request``: the bindings' reader checks
    it at submission, with the validator that ``Request``'s constructor calls."""
    fields: Dict[str, Any] = {
        "request_id": "duck",
        "prompt_token_ids": [1, 2, 3],
        "max_tokens": 4,
        "eos_token_id": None,
        "stop_token_ids": (),
        "ignore_eos": False,
        "min_tokens": 0,
        "priority": 0,
        "arrival_time": None,
        "lora_name": None,
        "cache_salt": None,
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


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


def other_scheduler_output() -> Any:
    """A step of another scheduler with the same step id and batch size as the pending one."""
    other = make_scheduler(24, method="dflash", k=3, block_size=4, max_model_len=MML)
    other.add_request(Request("x", [1] * 10, 20))
    other.add_request(Request("y", [2] * 7, 20))
    out = other.schedule()
    other.update_from_output(out, ModelRunnerOutput(out.req_ids, [[1], [2]]))
    return other.schedule()


class Case(NamedTuple):
    call: Callable[[Scheduler, Any], Any]
    error: Type[BaseException]
    fragment: str
    prepare: Optional[Callable[[Scheduler, Any], Any]] = None


def _apply(out: Any, sampled: Any, **kw: Any) -> Callable[[Scheduler, Any], Any]:
    return lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, sampled, **kw))


CASES: Dict[str, Case] = {
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
    # ---- update_from_output
    "runner req_ids in the wrong order": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput(list(reversed(o.req_ids)), good_sampled(o))
        ),
        InvalidArgumentError,
        "but the step scheduled",
    ),
    "runner req_ids too short": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids[:1], [[3]])),
        InvalidArgumentError,
        "ModelRunnerOutput has 1 req_ids but the step scheduled 2",
    ),
    "runner req_ids unknown": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(["run", "zzz"], [[3], [5]])),
        InvalidArgumentError,
        "ModelRunnerOutput.req_ids[",
    ),
    "fewer sampled lists than requests": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, [[3]])),
        InvalidArgumentError,
        "the model output has 1 requests but step 1 scheduled 2",
    ),
    "flat counts do not sum to the tokens": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3, 9, 5], dtype=np.int64), np.array([2, 2], dtype=np.int32)
            ),
        ),
        InvalidArgumentError,
        "sampled counts sum to 4 but 3 tokens were given",
    ),
    "more tokens than 1 + drafts": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput(
                o.req_ids, [[5, 6, 7] if r == "run2" else [3, 4, 1] for r in o.req_ids]
            ),
        ),
        InvalidArgumentError,
        "sampled 3 tokens but only 2 can be accepted (1 + 1 drafts)",
    ),
    "sampled token out of range": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput(o.req_ids, [[3, 2**31] if r == "run" else [5] for r in o.req_ids])
        ),
        InvalidArgumentError,
        "is outside [0, 2**31 - 1]",
    ),
    "sampled token negative": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput(o.req_ids, [[-1] if r == "run2" else [3] for r in o.req_ids])
        ),
        InvalidArgumentError,
        "= -1 is outside",
    ),
    "draft lists do not match the batch": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput(o.req_ids, good_sampled(o), draft_token_ids=[[1]])
        ),
        InvalidArgumentError,
        "1 draft lists for 2 requests",
    ),
    "draft token negative": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput(o.req_ids, good_sampled(o), draft_token_ids=[[1], [-4]])
        ),
        InvalidArgumentError,
        "draft_token_ids[1][0] = -4 is outside",
    ),
    "same output applied twice": Case(
        lambda s, o: s.update_from_output(o, good_output(o)),
        SchedulerStateError,
        "step 1 was already applied",
        prepare=lambda s, o: s.update_from_output(o, good_output(o)),
    ),
    "runner req_ids duplicated": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput([o.req_ids[0]] * 2, [[3], [5]])),
        InvalidArgumentError,
        "ModelRunnerOutput.req_ids[1] = ",
    ),
    "runner req_ids is a str": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput("ab", good_sampled(o))),
        InvalidArgumentError,
        "ModelRunnerOutput.req_ids[0] = a but the step scheduled",
    ),
    "empty output for a non-empty step": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput([], [])),
        InvalidArgumentError,
        "ModelRunnerOutput has 0 req_ids but the step scheduled 2",
    ),
    "more sampled lists than requests": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, [[3], [5], [6]])),
        InvalidArgumentError,
        "the model output has 3 requests but step 1 scheduled 2",
    ),
    "sampled entry None": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, [None, [5]])),
        InvalidArgumentError,
        "sampled_token_ids[0] must be a sequence of ints",
    ),
    "sampled entry a str": Case(
        lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, ["ab", [5]])),
        InvalidArgumentError,
        "sampled_token_ids[0] must be a sequence of ints, not a string",
    ),
    "flat counts: one per request": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3], dtype=np.int64), np.array([1], dtype=np.int32)
            ),
        ),
        InvalidArgumentError,
        "the model output has 1 requests but step 1 scheduled 2",
    ),
    "flat counts negative": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3], dtype=np.int64), np.array([2, -1], dtype=np.int64)
            ),
        ),
        InvalidArgumentError,
        "num_sampled_tokens[1] = -1 is outside",
    ),
    "flat counts float": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput.from_arrays(o.req_ids, np.array([3, 5]), np.array([1.0, 1.0]))
        ),
        ArgumentTypeError,
        "num_sampled_tokens must be a 1-D integer array, got ndim=1 dtype=float64",
    ),
    "flat tokens 2-D": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([[3, 5]], dtype=np.int64), np.array([1, 1], dtype=np.int32)
            ),
        ),
        InvalidArgumentError,
        "sampled_tokens_flat must be a 1-D integer array, got ndim=2",
    ),
    "flat token outside int32": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3, 2**31], dtype=np.int64), np.array([1, 1], dtype=np.int32)
            ),
        ),
        InvalidArgumentError,
        "sampled_tokens_flat[1] = 2147483648 is outside",
    ),
    "output is not a SchedulerOutput": Case(
        lambda s, o: s.update_from_output(None, good_output(o)),
        ArgumentTypeError,
        "output must be a SchedulerOutput (from schedule()), got NoneType",
    ),
    "runner output is not a ModelRunnerOutput": Case(
        lambda s, o: s.update_from_output(o, object()),
        InvalidArgumentError,
        "runner_output must be a ModelRunnerOutput (it has no req_ids)",
    ),
    # ---- drafts, finishing, lookups
    "drafts not a mapping": Case(
        lambda s, o: s.update_draft_token_ids([("run", [1])]),
        ArgumentTypeError,
        "draft token ids must be a Mapping[str, Sequence[int]]",
    ),
    "drafts keyed by int": Case(
        lambda s, o: s.update_draft_token_ids({1: [1]}),
        ArgumentTypeError,
        "keyed by request id",
    ),
    "drafts longer than K": Case(
        lambda s, o: s.update_draft_token_ids({"run2": [1], "run": [1, 2, 3, 4]}),
        InvalidArgumentError,
        'request "run" got 4 draft tokens but at most K = 3 can be verified',
    ),
    "draft arrays longer than K": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([1, 2, 3, 4], dtype=np.int32), np.array([0, 4], dtype=np.int32)
        ),
        InvalidArgumentError,
        "the request at batch index 1 got 4 draft tokens but at most K = 3",
    ),
    "runner drafts longer than K": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput(
                list(o.req_ids), good_sampled(o), draft_token_ids=[[1], [1, 2, 3, 4]]
            ),
        ),
        InvalidArgumentError,
        "draft_token_ids[1] has 4 tokens but at most K = 3",
    ),
    "min_tokens above max_tokens (duck)": Case(
        lambda s, o: s.add_request(duck_request(min_tokens=5, max_tokens=4)),
        InvalidArgumentError,
        "min_tokens (5) must be <= max_tokens (4)",
    ),
    "draft arrays: counts do not sum": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([1, 2, 3], dtype=np.int32), np.array([1, 1], dtype=np.int32)
        ),
        InvalidArgumentError,
        "draft counts sum to 2 but 3 draft tokens were given",
    ),
    "draft arrays: one count per request": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([1], dtype=np.int32), np.array([1], dtype=np.int32)
        ),
        InvalidArgumentError,
        "2 requests but 1 draft counts",
    ),
    "draft arrays: negative token": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([1, -2], dtype=np.int64), np.array([1, 1], dtype=np.int64)
        ),
        InvalidArgumentError,
        "draft_tokens[1] = -2 is outside",
    ),
    "draft arrays: negative count": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([1], dtype=np.int32), np.array([2, -1], dtype=np.int32)
        ),
        InvalidArgumentError,
        "num_draft_tokens[1] = -1 is outside",
    ),
    "drafts: token outside int32": Case(
        lambda s, o: s.update_draft_token_ids({"run": [2**31]}),
        InvalidArgumentError,
        'draft_token_ids["run"][0] = 2147483648 is outside',
    ),
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
    "sampled tokens of bools": Case(
        _apply(None, [[True], [5]]),
        ArgumentTypeError,
        "sampled_token_ids[0][0] must be an int, got the bool True",
    ),
    "sampled counts bool array": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3, 5], dtype=np.int32), np.array([True, True])
            ),
        ),
        ArgumentTypeError,
        "num_sampled_tokens must be a 1-D integer array, got ndim=1 dtype=bool",
    ),
    "draft lists of bools (runner)": Case(
        _apply(None, [[3, 9], [5, 6]], draft_token_ids=[[1], [True]]),
        ArgumentTypeError,
        "draft_token_ids[1][0] must be an int, got the bool True",
    ),
    "drafts dict of bools": Case(
        lambda s, o: s.update_draft_token_ids({"run": [np.True_]}),
        ArgumentTypeError,
        'draft_token_ids["run"][0] must be an int, got the bool True',
    ),
    "draft arrays of bools": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            o, np.array([True]), np.array([0, 1], dtype=np.int32)
        ),
        ArgumentTypeError,
        "draft_tokens must be a 1-D integer array, got ndim=1 dtype=bool",
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
    "negative int16 sampled counts": Case(
        lambda s, o: s.update_from_output(
            o,
            ModelRunnerOutput.from_arrays(
                o.req_ids, np.array([3], dtype=np.uint8), np.array([2, -1], dtype=np.int16)
            ),
        ),
        InvalidArgumentError,
        "num_sampled_tokens[1] = -1 is outside",
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
    "update_from_output_arrays: output is a dict": Case(
        lambda s, o: s.update_from_output_arrays({}, good_output(o)),
        ArgumentTypeError,
        "output must be a SchedulerOutput (from schedule()), got dict",
    ),
    "draft arrays: output is a str": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(
            "o", np.array([1], dtype=np.int32), np.array([0, 1], dtype=np.int32)
        ),
        ArgumentTypeError,
        "output must be a SchedulerOutput (from schedule()), got str",
    ),
    "draft arrays: tokens None": Case(
        lambda s, o: s.update_draft_token_ids_from_arrays(o, None, np.array([0, 0])),
        ArgumentTypeError,
        "draft_tokens must be a sequence of ints or a 1-D integer array, got NoneType",
    ),
    "pause state not a str": Case(
        lambda s, o: s.set_pause_state(1), ArgumentTypeError, "pause state must be"
    ),
    "reset_prefix_cache flag not a bool": Case(
        lambda s, o: s.reset_prefix_cache("yes"),
        ArgumentTypeError,
        "reset_running_requests must be a bool, got str",
    ),
    "preempt_all_running flag not a bool": Case(
        lambda s, o: s.preempt_all_running(drop_stale_outputs=None),
        ArgumentTypeError,
        "drop_stale_outputs must be a bool, got NoneType",
    ),
    "runner drafts not iterable": Case(
        _apply(None, [[3, 9], [5, 6]], draft_token_ids=5),
        ArgumentTypeError,
        "draft_token_ids must be a sequence of token lists (one per request) or None",
    ),
    "runner output without draft_token_ids (duck)": Case(
        lambda s, o: s.update_from_output(
            o,
            SimpleNamespace(
                req_ids=list(o.req_ids), sampled_tokens_flat=None, sampled_token_ids=good_sampled(o)
            ),
        ),
        InvalidArgumentError,
        "runner_output must be a ModelRunnerOutput (it has no draft_token_ids)",
    ),
    "runner output without samples (duck)": Case(
        lambda s, o: s.update_from_output(o, SimpleNamespace(req_ids=list(o.req_ids))),
        InvalidArgumentError,
        "runner_output must be a ModelRunnerOutput (it has no sampled_tokens_flat)",
    ),
    "flat tokens a str": Case(
        lambda s, o: s.update_from_output(
            o, ModelRunnerOutput.from_arrays(o.req_ids, "ab", np.array([1, 1]))
        ),
        ArgumentTypeError,
        "sampled_tokens_flat must be a sequence of ints, not a string",
    ),
    "sampled entry a dict": Case(
        _apply(None, [{"a": 1}, [5]]),
        ArgumentTypeError,
        "sampled_token_ids[0] must be a sequence of ints or a 1-D integer array, got dict",
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


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_changes_nothing(name: str) -> None:
    case = CASES[name]
    sched, out = populated()
    pending = True
    if case.prepare is not None:
        case.prepare(sched, out)
        pending = False
    before = snapshot(sched)
    with pytest.raises(case.error, match=re.escape(case.fragment)) as info:
        case.call(sched, out)
    assert isinstance(info.value, DFlashRsError)
    assert snapshot(sched) == before
    sched.check_invariants()
    if pending:
        # The failed call did not consume the step: its real output still applies.
        results = sched.update_from_output(out, good_output(out))
        assert {r.request_id: r.new_token_ids for r in results} == {
            "run": [3, 9],
            "run2": [5, 6],
        }
        assert sched.num_computed_tokens("run") == len(sched.all_token_ids("run")) - 1
    sched.check_invariants()
    nxt = sched.schedule()
    assert set(nxt.req_ids) == {"run", "run2"}
    sched.check_invariants()


def test_error_classes_are_builtin_compatible() -> None:
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(DuplicateRequestError, ValueError)
    assert issubclass(PromptTooLongError, ValueError)
    assert issubclass(UnknownRequestError, KeyError)
    assert issubclass(SchedulerStateError, RuntimeError)


def test_update_before_any_schedule() -> None:
    # The only output that exists before this scheduler's first schedule() is another's.
    sched = make_scheduler(24)
    sched.add_request(Request("a", [1, 2, 3], 4))
    foreign = other_scheduler_output()
    before = snapshot(sched)
    with pytest.raises(InvalidArgumentError, match="another Scheduler"):
        sched.update_from_output(foreign, ModelRunnerOutput(foreign.req_ids, [[1], [2]]))
    assert snapshot(sched) == before
    sched.check_invariants()


def test_old_output_applied_again_while_a_later_step_is_pending() -> None:
    sched, out = populated()
    sched.update_from_output(out, good_output(out))
    later = sched.schedule()
    before = snapshot(sched)
    with pytest.raises(SchedulerStateError, match="the output of step 1 was already applied"):
        sched.update_from_output(out, good_output(out))
    assert snapshot(sched) == before
    sched.update_from_output(later, ModelRunnerOutput(later.req_ids, [[1]] * len(later.req_ids)))
    sched.check_invariants()


def test_outputs_must_be_applied_in_order() -> None:
    sched = make_scheduler(24)
    sched.add_request(Request("a", [1, 2, 3], 4))
    out0 = sched.schedule()
    sched.add_request(Request("b", [4, 5], 4))
    out1 = sched.schedule()  # "a" is still in flight; "b" is admitted
    assert list(out1.req_ids) == ["b"]
    before = snapshot(sched)
    with pytest.raises(SchedulerStateError, match="outputs must be applied in order"):
        sched.update_from_output(out1, ModelRunnerOutput(out1.req_ids, [[7]]))
    assert snapshot(sched) == before
    sched.update_from_output(out0, ModelRunnerOutput(out0.req_ids, [[6]]))
    sched.update_from_output(out1, ModelRunnerOutput(out1.req_ids, [[7]]))
    assert sched.all_token_ids("a") == [1, 2, 3, 6]
    assert sched.all_token_ids("b") == [4, 5, 7]
    sched.check_invariants()


def test_output_of_another_scheduler_is_rejected() -> None:
    """A SchedulerOutput belongs to the scheduler that produced it. Handing it (with its own,
    matching ModelRunnerOutput) to another scheduler whose pending step has the same id and batch
    size must fail, not append "x"'s and "y"'s tokens to "run" and "run2"."""
    sched, out = populated()
    foreign = other_scheduler_output()
    assert foreign.step_id == out.step_id and len(foreign.req_ids) == len(out.req_ids)
    before = snapshot(sched)
    with pytest.raises((InvalidArgumentError, SchedulerStateError)):
        sched.update_from_output(foreign, ModelRunnerOutput(foreign.req_ids, [[7], [8]]))
    assert snapshot(sched) == before
    sched.update_from_output(out, good_output(out))
    sched.check_invariants()


def test_failed_draft_updates_install_nothing() -> None:
    """update_draft_token_ids parses everything before applying anything."""
    sched, out = populated()
    sched.update_from_output(out, good_output(out))
    assert sched.update_draft_token_ids({"run": [7, 8]}) == 1
    with pytest.raises(InvalidArgumentError, match="outside"):
        sched.update_draft_token_ids({"run": [1], "run2": [2, -1]})
    with pytest.raises(InvalidArgumentError, match="draft counts sum"):
        sched.update_draft_token_ids_from_arrays(
            out, np.array([1, 2, 3], dtype=np.int32), np.array([1, 1], dtype=np.int32)
        )
    with pytest.raises(InvalidArgumentError, match="1 draft lists for 2 requests"):
        sched.update_from_output(
            out, ModelRunnerOutput(out.req_ids, good_sampled(out), draft_token_ids=[[1]])
        )
    nxt = sched.schedule()
    assert nxt.scheduled_spec_decode_tokens == {"run": [7, 8]}
    assert nxt.num_scheduled_tokens == {"run": 3, "run2": 1}


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


def _config_fields(**overrides: Any) -> SimpleNamespace:
    fields: Dict[str, Any] = {
        "num_blocks": 20,
        "block_size": 16,
        "max_model_len": 64,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 64,
        "enable_prefix_caching": True,
        "enable_chunked_prefill": True,
        "long_prefill_token_threshold": 0,
        "policy": "fcfs",
        "speculative": None,
        "hash_algo": "sha256",
        "hash_seed": None,
        "lookahead_policy": "correct",
    }
    fields.update(overrides)
    return SimpleNamespace(**fields)


def _config_without(name: str) -> SimpleNamespace:
    fields = vars(_config_fields())
    del fields[name]
    return SimpleNamespace(**fields)


_INT32_FIELDS = (
    "num_blocks",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
)

_PAST_RANGE = "is out of range: integers must lie in [-2**63, 2**63 - 1]"

#: Bad fields of a scheduler config: overrides of ``_config_fields()``, the error and its exact
#: message. ``SchedulerConfig`` and a duck-typed config given to ``Scheduler`` are checked by one
#: validator, so both raise exactly this.
FIELD_CASES: Dict[str, Tuple[Dict[str, Any], Type[BaseException], str]] = {
    "num_blocks 1": (
        {"num_blocks": 1},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got 1",
    ),
    "num_blocks 0": (
        {"num_blocks": 0},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got 0",
    ),
    "num_blocks negative": (
        {"num_blocks": -3},
        InvalidArgumentError,
        "config.num_blocks must be >= 2, got -3",
    ),
    "num_blocks str": (
        {"num_blocks": "10"},
        ArgumentTypeError,
        "config.num_blocks must be an int, got str",
    ),
    "num_blocks bool": (
        {"num_blocks": True},
        ArgumentTypeError,
        "config.num_blocks must be an int, got the bool True",
    ),
    "num_blocks numpy bool": (
        {"num_blocks": np.True_},
        ArgumentTypeError,
        "config.num_blocks must be an int, got the bool True",
    ),
    "num_blocks huge": (
        {"num_blocks": 2**70},
        InvalidArgumentError,
        f"config.num_blocks = {2**70} {_PAST_RANGE}",
    ),
    "block_size 0": (
        {"block_size": 0},
        InvalidArgumentError,
        "config.block_size must be >= 1, got 0",
    ),
    "block_size negative": (
        {"block_size": -16},
        InvalidArgumentError,
        "config.block_size must be >= 1, got -16",
    ),
    "block_size float": (
        {"block_size": 16.0},
        ArgumentTypeError,
        "config.block_size must be an int, got float",
    ),
    "max_model_len 1": (
        {"max_model_len": 1},
        InvalidArgumentError,
        "config.max_model_len must be >= 2, got 1",
    ),
    "max_model_len huge": (
        {"max_model_len": 2**64},
        InvalidArgumentError,
        f"config.max_model_len = {2**64} {_PAST_RANGE}",
    ),
    "max_num_seqs 0": (
        {"max_num_seqs": 0},
        InvalidArgumentError,
        "config.max_num_seqs must be >= 1, got 0",
    ),
    "max_num_seqs negative": (
        {"max_num_seqs": -1},
        InvalidArgumentError,
        "config.max_num_seqs must be >= 1, got -1",
    ),
    "budget 0": (
        {"max_num_batched_tokens": 0},
        InvalidArgumentError,
        "config.max_num_batched_tokens must be >= 1, got 0",
    ),
    "no chunking and budget < max_model_len": (
        {"enable_chunked_prefill": False, "max_num_batched_tokens": 32},
        InvalidArgumentError,
        "without chunked prefill, max_num_batched_tokens (32) must be >= max_model_len (64)",
    ),
    "long_prefill_token_threshold negative": (
        {"long_prefill_token_threshold": -1},
        InvalidArgumentError,
        "config.long_prefill_token_threshold must be >= 0, got -1",
    ),
    "draft_slots_per_request bool": (
        {"draft_slots_per_request": True},
        ArgumentTypeError,
        "config.draft_slots_per_request must be an int, got the bool True",
    ),
    "draft slots fill the budget": (
        {"draft_slots_per_request": 64},
        InvalidArgumentError,
        "draft_slots_per_request (64) must be below max_num_batched_tokens (64): no request "
        "could be scheduled",
    ),
    "hash_lookahead_tokens 65": (
        {"hash_lookahead_tokens": 65},
        InvalidArgumentError,
        "hash_lookahead_tokens 65 is above 64",
    ),
    "hash lookahead with the block drop": (
        {"hash_lookahead_tokens": 1, "drop_last_hit_block": True},
        InvalidArgumentError,
        "hash_lookahead_tokens and drop_last_hit_block exclude each other: lookahead hashes "
        "make the last hit block reusable, the drop recomputes it",
    ),
    "max_loras negative": (
        {"max_loras": -1},
        InvalidArgumentError,
        "config.max_loras must be >= 0, got -1",
    ),
    "enable_prefix_caching str": (
        {"enable_prefix_caching": "no"},
        ArgumentTypeError,
        "config.enable_prefix_caching must be a bool, got str",
    ),
    "enable_chunked_prefill int": (
        {"enable_chunked_prefill": 1},
        ArgumentTypeError,
        "config.enable_chunked_prefill must be a bool, got int",
    ),
    "verify_prefix_hits str": (
        {"verify_prefix_hits": "yes"},
        ArgumentTypeError,
        "config.verify_prefix_hits must be a bool, got str",
    ),
    "async_scheduling int": (
        {"async_scheduling": 1},
        ArgumentTypeError,
        "config.async_scheduling must be a bool, got int",
    ),
    "policy": (
        {"policy": "lifo"},
        InvalidArgumentError,
        'unknown policy "lifo"; expected "fcfs" or "priority"',
    ),
    "policy None": (
        {"policy": None},
        ArgumentTypeError,
        "config.policy must be a str, got NoneType",
    ),
    "lookahead_policy": (
        {"lookahead_policy": "legacy"},
        InvalidArgumentError,
        'unknown lookahead_policy "legacy"; expected "correct", "legacy-first-prefill" or '
        '"legacy-k"',
    ),
    "hash_algo": (
        {"hash_algo": "md5"},
        InvalidArgumentError,
        'unknown hash_algo "md5"; expected one of "sha256", "blake3", "xxh3_128"',
    ),
    "hash_seed float": (
        {"hash_seed": 1.5},
        ArgumentTypeError,
        "hash_seed must be str, bytes, int or None, got float",
    ),
    "hash_seed bool": (
        {"hash_seed": True},
        ArgumentTypeError,
        "hash_seed must be str, bytes, int or None, got bool",
    ),
    "vllm_semantics float": (
        {"vllm_semantics": 0.33},
        ArgumentTypeError,
        "config.vllm_semantics must be a str, got float",
    ),
    "vllm_semantics unknown": (
        {"vllm_semantics": "0.31"},
        InvalidArgumentError,
        'unknown vLLM semantics "0.31"; expected "0.32" or "0.33"',
    ),
    "speculative a str": (
        {"speculative": "dflash"},
        ArgumentTypeError,
        "config.speculative must be a SpeculativeConfig or None, got str",
    ),
    # Every size field is int32 on the model side.
    **{
        f"{field} above int32": (
            {field: 2**31},
            InvalidArgumentError,
            f"{field} (2147483648) must be at most 2**31 - 1 = 2147483647: block ids, token "
            "positions and counts reach the model runner as int32",
        )
        for field in _INT32_FIELDS
    },
    "pool one block short of one max_model_len request": (
        {"num_blocks": 4},
        InvalidArgumentError,
        "num_blocks (4) cannot hold one request of max_model_len (64) tokens: that needs "
        "cdiv(64, block_size 16) = 4 blocks plus the null block, 5 in all; raise num_blocks or "
        "lower max_model_len",
    ),
}


def _error_of(make: Callable[[], Any]) -> BaseException:
    with pytest.raises(DFlashRsError) as info:
        make()
    return info.value


@pytest.mark.parametrize("name", list(FIELD_CASES))
def test_bad_config_field_raises_one_error_for_dataclass_and_duck_configs(name: str) -> None:
    overrides, error, message = FIELD_CASES[name]
    fields = {**vars(_config_fields()), **overrides}
    from_dataclass = _error_of(lambda: SchedulerConfig(**fields))
    from_duck = _error_of(lambda: Scheduler(_config_fields(**overrides)))
    for raised in (from_dataclass, from_duck):
        assert type(raised) is error
        assert str(raised) == message


#: Bad speculative configs: method, K, the error, and its message after "speculative." or
#: "config.speculative." (None: a message without that prefix).
SPECULATIVE_CASES: Dict[str, Tuple[Any, Any, Type[BaseException], str, bool]] = {
    "unknown method": (
        "medusa",
        3,
        InvalidArgumentError,
        'unknown speculative method "medusa"; expected one of dflash, eagle, eagle3, mtp, '
        "draft_model, ngram, suffix",
        False,
    ),
    "method in the wrong case": (
        "DFlash",
        2,
        InvalidArgumentError,
        'unknown speculative method "DFlash"; expected one of dflash, eagle, eagle3, mtp, '
        "draft_model, ngram, suffix",
        False,
    ),
    "method None": (None, 2, ArgumentTypeError, "method must be a str, got NoneType", True),
    "method an int": (3, 3, ArgumentTypeError, "method must be a str, got int", True),
    "K = 0": (
        "dflash",
        0,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got 0",
        True,
    ),
    "K negative": (
        "dflash",
        -1,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got -1",
        True,
    ),
    "K = 65": (
        "eagle",
        65,
        InvalidArgumentError,
        "num_speculative_tokens must be in [1, 64], got 65",
        True,
    ),
    "K bool": (
        "dflash",
        True,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got the bool True",
        True,
    ),
    "K numpy bool": (
        "dflash",
        np.True_,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got the bool True",
        True,
    ),
    "K float": (
        "eagle",
        2.0,
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got float",
        True,
    ),
    "K str": (
        "dflash",
        "3",
        ArgumentTypeError,
        "num_speculative_tokens must be an int, got str",
        True,
    ),
    "K huge": (
        "dflash",
        2**70,
        InvalidArgumentError,
        f"num_speculative_tokens = {2**70} {_PAST_RANGE}",
        True,
    ),
}


@pytest.mark.parametrize("name", list(SPECULATIVE_CASES))
def test_bad_speculative_config_raises_one_error_alone_and_in_a_scheduler(name: str) -> None:
    method, k, error, message, prefixed = SPECULATIVE_CASES[name]
    alone = _error_of(lambda: SpeculativeConfig(method, k))
    duck = SimpleNamespace(method=method, num_speculative_tokens=k)
    in_scheduler = _error_of(lambda: Scheduler(_config_fields(speculative=duck)))
    for raised, prefix in ((alone, "speculative."), (in_scheduler, "config.speculative.")):
        assert type(raised) is error
        assert str(raised) == (prefix + message if prefixed else message)


CONFIG_CASES: Dict[str, Tuple[Callable[[], Any], Type[BaseException], str]] = {
    "method none alone": (
        lambda: SpeculativeConfig("none", 0),
        InvalidArgumentError,
        'unknown speculative method "none": without speculation pass speculative=None',
    ),
    "K without a method (duck)": (
        lambda: Scheduler(
            _config_fields(speculative=SimpleNamespace(method="none", num_speculative_tokens=2))
        ),
        InvalidArgumentError,
        "num_speculative_tokens must be 0 without a speculative method",
    ),
    "speculative without K (duck)": (
        lambda: Scheduler(_config_fields(speculative=SimpleNamespace(method="dflash"))),
        InvalidArgumentError,
        'config.speculative has no attribute "num_speculative_tokens"',
    ),
    "not a config": (
        lambda: Scheduler(object()),
        InvalidArgumentError,
        'config has no attribute "num_blocks"',
    ),
    "no speculative attribute (duck)": (
        lambda: Scheduler(_config_without("speculative")),
        InvalidArgumentError,
        'config has no attribute "speculative"',
    ),
    "pool short of the default max_model_len": (
        lambda: SchedulerConfig(10),
        InvalidArgumentError,
        "num_blocks (10) cannot hold one request of max_model_len (8192) tokens",
    ),
    "the issue's max_model_len 2**40": (
        lambda: SchedulerConfig(num_blocks=64, max_model_len=2**40, max_num_seqs=8),
        InvalidArgumentError,
        "max_model_len (1099511627776) must be at most 2**31 - 1",
    ),
    "ModelRunnerOutput without samples": (
        lambda: ModelRunnerOutput(["a"]),
        InvalidArgumentError,
        "give either sampled_token_ids or sampled_tokens_flat",
    ),
    "ModelRunnerOutput with lists and arrays": (
        lambda: ModelRunnerOutput(
            ["a"], [[1]], sampled_tokens_flat=np.array([1]), num_sampled_tokens=np.array([1])
        ),
        InvalidArgumentError,
        "give either sampled_token_ids or sampled_tokens_flat",
    ),
    "ModelRunnerOutput flat tokens without counts": (
        lambda: ModelRunnerOutput(["a"], sampled_tokens_flat=np.array([1])),
        InvalidArgumentError,
        "sampled_tokens_flat and num_sampled_tokens go together",
    ),
    "ModelRunnerOutput counts without flat tokens": (
        lambda: ModelRunnerOutput(["a"], num_sampled_tokens=np.array([1])),
        InvalidArgumentError,
        "sampled_tokens_flat and num_sampled_tokens go together",
    ),
}


@pytest.mark.parametrize("name", list(CONFIG_CASES))
def test_bad_config(name: str) -> None:
    make, error, fragment = CONFIG_CASES[name]
    with pytest.raises(error, match=re.escape(fragment)) as info:
        make()
    assert isinstance(info.value, DFlashRsError)


def test_numpy_integers_in_configs_are_stored_as_ints() -> None:
    config = SchedulerConfig(
        np.int64(64),
        block_size=np.int32(16),
        max_model_len=np.uint16(256),
        speculative=SpeculativeConfig("dflash", np.int8(3)),
    )
    assert type(config.num_blocks) is int and config.num_blocks == 64
    assert type(config.block_size) is int and type(config.max_model_len) is int
    assert speculative_k_is_int(config)


def speculative_k_is_int(config: SchedulerConfig) -> bool:
    assert config.speculative is not None
    return type(config.speculative.num_speculative_tokens) is int


def test_argument_type_error_is_a_type_error() -> None:
    """Callers catching the builtin TypeError (as for PyO3's own argument errors) keep working."""
    assert issubclass(ArgumentTypeError, InvalidArgumentError)
    assert issubclass(ArgumentTypeError, TypeError)
    sched, _ = populated()
    with pytest.raises(TypeError):
        sched.block_ids(5)
    with pytest.raises(ValueError):
        sched.block_ids(5)


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
    duck = Scheduler(_config_fields(num_blocks=np.int64(20), block_size=np.uint8(16)))
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


def test_sampled_tokens_for_a_request_finished_meanwhile_are_dropped() -> None:
    """A request aborted while its step is in flight: the step's output still names it and
    carries its tokens; they are dropped, its blocks are freed once, the others proceed."""
    sched, out = populated()
    blocks_of_run = len(sched.block_ids("run"))
    free_before = sched.num_free_blocks
    assert sched.finish_requests(["run"]) == ["run"]
    assert sched.num_free_blocks == free_before + blocks_of_run
    results = sched.update_from_output(out, good_output(out))
    assert [(r.request_id, r.new_token_ids) for r in results] == [("run2", [5, 6])]
    assert not sched.has_request("run")
    assert sched.num_free_blocks == free_before + blocks_of_run
    sched.check_invariants()
    nxt = sched.schedule()
    assert nxt.finished_req_ids == {"run"} and "run" not in nxt.req_ids
    with pytest.raises(UnknownRequestError):
        sched.block_ids("run")
    sched.check_invariants()


def test_non_power_of_two_block_size_is_supported() -> None:
    """No entry point requires a power-of-two block size: 3-token blocks schedule and map
    positions like any other size."""
    sched = make_scheduler(12, block_size=3, max_model_len=30, method="dflash", k=2)
    sched.add_request(Request("a", list(range(7)), 4))
    out = sched.schedule()
    # 7 tokens + K + 1 = 3 lookahead slots -> 10 positions -> 4 blocks of 3.
    assert out.num_blocks_per_row.tolist() == [4]
    assert out.block_table[0, :4].tolist() == sched.block_ids("a")
    sched.check_invariants()


_OVERSIZED = """
import resource, sys, time
from dflash_rs import InvalidArgumentError, KVCacheManager, Scheduler, SchedulerConfig

def peak_mib():
    # This process's peak RSS: VmHWM restarts at exec, unlike ru_maxrss (the parent's counts).
    try:
        with open("/proc/self/status") as status:
            return next(int(l.split()[1]) for l in status if l.startswith("VmHWM:")) // 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024

def bypass(**fields):
    # Past the Python wrapper's own checks, to the core's.
    config = SchedulerConfig(num_blocks=64, max_model_len=1008)
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config

start = time.perf_counter()
try:
    {call}
except InvalidArgumentError as exc:
    print("InvalidArgumentError:", exc)
    print("seconds", time.perf_counter() - start)
    print("peak_mib", peak_mib())
    sys.exit(0)
print("accepted after", time.perf_counter() - start, "s with a peak of", peak_mib(), "MiB")
sys.exit(3)
"""

_I32 = 2**31 - 1

#: Configs whose tables cannot (or may not) be allocated: the call, and what the error says.
OVERSIZED: Dict[str, Tuple[str, str]] = {
    "the issue's repro": (
        "Scheduler(SchedulerConfig(num_blocks=64, max_model_len=2**40, max_num_seqs=8))",
        "max_model_len (1099511627776) must be at most 2**31 - 1",
    ),
    **{
        f"{field} above int32 (core)": (
            f"Scheduler(bypass({field}=2**40))",
            f"{field} (1099511627776) must be at most 2**31 - 1",
        )
        for field in _INT32_FIELDS
    },
    # A 2 GiB table that the old code zero-filled for a pool that holds 1008 tokens.
    "max_model_len beyond the pool (core)": (
        f"Scheduler(bypass(max_model_len={_I32}, max_num_seqs=4))",
        f"num_blocks (64) cannot hold one request of max_model_len ({_I32}) tokens",
    ),
    "block table beyond memory": (
        f"Scheduler(SchedulerConfig(num_blocks=2**21 + 1, block_size=1024, "
        f"max_model_len={_I32}, max_num_seqs={_I32}))",
        f"the block table (max_num_seqs = {_I32} rows of cdiv(max_model_len = {_I32}, "
        "block_size = 1024) = 2097152 int32 entries) takes 16.0 PiB",
    ),
    "pool beyond memory": (
        f"Scheduler(SchedulerConfig(num_blocks={_I32}, block_size=2**20, max_model_len=2**20, "
        "max_num_seqs=1))",
        f"the pool's per-block tables (num_blocks = {_I32} blocks, each with a copy of its "
        "block_size = 1048576 tokens) take 8.0 PiB",
    ),
    "KVCacheManager pool beyond memory": (
        f"KVCacheManager({_I32}, 2**20, 2**20)",
        "the config needs 8.0 PiB up front, more than the",
    ),
    "KVCacheManager num_blocks above int32": (
        "KVCacheManager(2**31, 16, 1024)",
        "num_blocks (2147483648) must be at most 2**31 - 1",
    ),
}


@pytest.mark.parametrize("name", list(OVERSIZED))
def test_oversized_config_raises_before_allocating(name: str) -> None:
    """A config whose up-front tables are out of bounds raises InvalidArgumentError naming the
    fields and the size, at once and without touching the memory (peak RSS of the child). Run
    in a child process with an 8 GiB address-space limit, so that a regression cannot take the
    session down."""
    import resource
    import subprocess
    import sys

    def limit_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    call, fragment = OVERSIZED[name]
    done = subprocess.run(
        [sys.executable, "-c", _OVERSIZED.format(call=call)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_memory,
        check=False,
    )
    if "Traceback" in done.stderr:  # a Python error in the child is not the failure expected
        raise RuntimeError(done.stderr)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-300:])
    assert fragment in done.stdout
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines()[1:])
    assert float(lines["seconds"]) < 1.0, done.stdout
    assert int(lines["peak_mib"]) < 300, done.stdout


class _RaisingIndex:
    """A token whose ``__index__`` raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __index__(self) -> int:
        raise self.exc


_FATAL_CALLS: Dict[str, Callable[[Scheduler, Any, Any], Any]] = {
    "prompt": lambda s, out, t: s.add_request(Request("new", [1, t, 3], 4)),
    "sampled": lambda s, out, t: s.update_from_output(
        out, ModelRunnerOutput(list(out.req_ids), [[3, t], [5, 6]])
    ),
    "drafts": lambda s, out, t: s.update_draft_token_ids({"run": [4, t]}),
}


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, MemoryError])
@pytest.mark.parametrize("where", list(_FATAL_CALLS))
def test_base_exceptions_inside_a_token_propagate_unchanged(
    where: str, exc: Type[BaseException]
) -> None:
    """A ``KeyboardInterrupt`` (or ``SystemExit``, ``MemoryError``) raised while a token is
    converted reaches the caller as itself, not as ``InvalidArgumentError``; nothing changes."""
    sched, out = populated()
    before = snapshot(sched)
    raised = exc()
    with pytest.raises(exc) as info:
        _FATAL_CALLS[where](sched, out, _RaisingIndex(raised))
    assert info.value is raised
    assert snapshot(sched) == before
    sched.check_invariants()
    results = sched.update_from_output(out, good_output(out))
    assert {r.request_id: r.new_token_ids for r in results} == {"run": [3, 9], "run2": [5, 6]}


def test_a_drafts_dict_mutated_while_parsed_is_parsed_as_it_was() -> None:
    """A token whose ``__index__`` adds a key to the drafts dict being parsed: no Rust panic
    (``PanicException``) crosses into Python; the items as they were when parsing began apply."""
    sched, out = populated()
    drafts: Dict[str, Any] = {}

    class Mutating:
        def __index__(self) -> int:
            drafts["late"] = [1]
            return 7

    drafts["run"] = [Mutating(), 8]
    sched.update_from_output(out, good_output(out))
    sched.update_draft_token_ids(drafts)
    nxt = sched.schedule()
    assert nxt.scheduled_spec_decode_tokens["run"] == [7, 8]
    sched.check_invariants()


def test_min_tokens_above_max_tokens_is_refused_at_construction() -> None:
    with pytest.raises(InvalidArgumentError, match=re.escape("min_tokens (5) must be <=")):
        Request("r", [1, 2], 4, min_tokens=5)
    assert Request("r", [1, 2], 4, min_tokens=4).min_tokens == 4


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
