"""Misuse of the step protocol (outputs applied twice, out of order or to another scheduler)
and bad model outputs and drafts raise a typed error and change nothing; what the scheduler
does with tokens of requests finished meanwhile and with fatal errors raised inside a token.
The shared pieces are in bad_input.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Dict, Tuple, Type

import numpy as np
import pytest

from dflash_rs import (
    ArgumentTypeError,
    InvalidArgumentError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerStateError,
    UnknownRequestError,
)

from .bad_input import (
    Case,
    check_bad_input,
    check_raises,
    good_output,
    good_sampled,
    other_scheduler_output,
    populated,
    snapshot,
)
from .drivers import make_scheduler


def _apply(out: Any, sampled: Any, **kw: Any) -> Callable[[Scheduler, Any], Any]:
    return lambda s, o: s.update_from_output(o, ModelRunnerOutput(o.req_ids, sampled, **kw))


#: Bad model outputs, drafts and control calls, each raising on ``populated()``'s scheduler.
STEP_CASES: Dict[str, Case] = {
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
    # ---- drafts
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
    # ---- bools are not token ids or counts (bool is an int subclass; numpy.bool_ has no
    # __index__ but must be named as a bool too)
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
    # ---- wrong argument types raise ArgumentTypeError (an InvalidArgumentError and a
    # TypeError), not the builtin TypeError of PyO3's argument extraction
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
}


@pytest.mark.parametrize("name", list(STEP_CASES))
def test_bad_input_changes_nothing(name: str) -> None:
    check_bad_input(STEP_CASES[name])


#: ``ModelRunnerOutput`` built wrong: refused at construction.
RUNNER_OUTPUT_CASES: Dict[str, Tuple[Callable[[], Any], Type[BaseException], str]] = {
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


@pytest.mark.parametrize("name", list(RUNNER_OUTPUT_CASES))
def test_bad_runner_output(name: str) -> None:
    check_raises(*RUNNER_OUTPUT_CASES[name])


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
