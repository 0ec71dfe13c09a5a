"""Launch plans cached per buffer set: a repeated call skips the checks, a changed one does not.

``expand_dflash_inputs(..., out=buffers)`` keeps a plan per call signature (tensor metadata and
scalars) in ``out._launch_plans``; a call that matches one launches it without checking its
arguments again. These tests pin what that may and may not skip: results equal the uncached
path's and the oracle's; any change to a buffer (a new tensor, or one changed in place) is
checked again and raises the same typed error; value checks still run on every validated call;
a refused call launches nothing.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from dflash_expand_oracle import POISON, Case, assert_matches, oracle, poison, random_case
from test_dflash_expand_validation import STRUCTURAL, VALUES, _call, _escape, _good

import dflash_rs.kernels.api as api
from dflash_rs.errors import InvalidArgumentError
from dflash_rs.kernels import DFlashInputs, expand_dflash_inputs
from dflash_rs.kernels._launch_cache import MAX_PLANS, call_signature
from dflash_rs.kernels._validate import prepare_expand_args
from dflash_rs.kernels.dflash_expand import MAX_BATCH_SHAPES, kernel_tensors
from dflash_rs.kernels.result import BUFFER_NAMES, buffer_tensors


@pytest.fixture
def checks(monkeypatch) -> list[int]:
    """Counts the calls that ran the argument checks (the uncached path)."""
    calls = [0]
    prepare = api.prepare_expand_args

    def counting(*args, **kwargs):
        calls[0] += 1
        return prepare(*args, **kwargs)

    monkeypatch.setattr(api, "prepare_expand_args", counting)
    return calls


def _snapshot(out: DFlashInputs) -> list[list[int]]:
    """Every output buffer of ``out`` (its tensor fields), as lists."""
    values = (getattr(out, f.name) for f in dataclasses.fields(out))
    return [v.cpu().tolist() for v in values if isinstance(v, torch.Tensor)]


def _new_data(case: Case, rng: np.random.Generator) -> Case:
    """``case`` with fresh data of the same shapes: lengths, positions, table, counts."""
    cuts = np.sort(rng.choice(case.num_ctx - 1, case.num_reqs - 1, replace=False) + 1)
    lens = np.diff(np.concatenate([[0], cuts, [case.num_ctx]]))
    starts = rng.integers(0, 40 * case.block_size + 1, case.num_reqs)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    fresh = dataclasses.replace(
        case,
        next_token_ids=rng.integers(0, 150_000, case.num_reqs).astype(np.int32),
        target_positions=positions.astype(np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        block_table=rng.integers(0, 5000, case.block_table.shape).astype(np.int32),
    )
    k = case.num_speculative_tokens
    fresh.num_rejected_tokens = np.minimum(rng.integers(0, k + 1, case.num_reqs), lens - 1)
    fresh.num_rejected_tokens = fresh.num_rejected_tokens.astype(np.int32)
    if case.num_blocks_per_row is not None:
        count = len(case.num_blocks_per_row)
        fresh.num_blocks_per_row = rng.integers(0, case.table_width + 1, count).astype(np.int32)
    return fresh


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("validate", [True, False])
def test_cached_calls_follow_new_data_and_match_the_oracle_and_the_uncached_path(
    device, seeded_rng, checks, strict, validate
):
    """Same tensors, new data on every call: the first call is checked, the later ones launch
    the cached plan (it holds no data), and each equals the oracle and fresh buffers' result."""
    seed, rng = seeded_rng
    case = random_case(
        rng, seed, num_reqs=37, num_ctx=300, num_spec=5, block_size=16, rejected=True,
        strict=strict,
    )  # fmt: skip
    positional, keywords = case.torch_args(device)
    out = case.poisoned_out(device)
    parent = positional[3]
    for step in range(4):
        if step:
            case = _new_data(case, rng)
            new_positional, new_keywords = case.torch_args(device)
            for tensor, new in zip(positional, new_positional):
                tensor.copy_(new)
            for name in ("num_rejected_tokens", "num_blocks_per_row"):
                if name in keywords:
                    keywords[name].copy_(new_keywords[name])
        assert positional[3] is parent
        poison(out)
        result = expand_dflash_inputs(*positional, **keywords, out=out, validate=validate)
        assert result is out
        assert_matches(out, oracle(case), case, f"cached path, call {step}")
        assert not (out.violation_partials == POISON).any()
        fresh = case.poisoned_out(device)
        expand_dflash_inputs(*positional, **keywords, out=fresh, validate=validate)
        assert _snapshot(fresh) == _snapshot(out)
    # One check for the first call into `out`, one per fresh buffer set; none for cached calls.
    assert checks[0] == 1 + 4
    assert len(out._launch_plans) == 1


# Every structural error but the one about calls without out= (these calls all pass out=).
WITH_OUT = [entry for entry in STRUCTURAL if entry[0] != "accumulate without out"]


@pytest.mark.parametrize(
    ("what", "change", "message"), WITH_OUT, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_changed_argument_after_a_cached_call_is_checked_again(device, what, change, message):
    """Every structural error still raises with its message after the same buffers were used
    (and their plan cached) by a good call."""
    kwargs = _good(device)
    out = DFlashInputs.empty(2, 5, 2, device)
    _call({**kwargs, "out": out})
    _call({**kwargs, "out": out})
    assert len(out._launch_plans) == 1
    kwargs["out"] = out
    change(kwargs)
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call(kwargs)


def _swap_device(tensor: torch.Tensor) -> None:
    torch.utils.swap_tensors(tensor, torch.empty_like(tensor, device="meta"))


# (name, change in place to a buffer of the cached call, expected message fragment)
IN_PLACE = [
    (
        "out buffer shrunk",
        lambda a: a["out"].query_positions.resize_(3),
        "out query buffers (input_ids, query_positions, query_slot_mapping) differ in size",
    ),
    (
        "out buffer dtype",
        lambda a: setattr(
            a["out"].context_slot_mapping,
            "data",
            torch.zeros(5, dtype=torch.int32, device=a["block_table"].device),
        ),
        "out.context_slot_mapping must have dtype torch.int64",
    ),
    (
        "out buffer strided",
        lambda a: a["out"].input_ids.as_strided_((3,), (2,)),
        "out.input_ids must be contiguous",
    ),
    (
        "out buffer device",
        lambda a: _swap_device(a["out"].token_indices_to_sample),
        "out.token_indices_to_sample is on meta",
    ),
    (
        "violation slots shrunk",
        lambda a: a["out"].violation_partials.resize_(0),
        "out.violation_partials has 0 slots",
    ),
    (
        "positions dtype",
        lambda a: setattr(a["target_positions"], "data", a["target_positions"].int()),
        "target_positions must have dtype torch.int64",
    ),
    (
        "positions device",
        lambda a: _swap_device(a["target_positions"]),
        "next_token_ids is on",
    ),
    (
        "ids 2-D",
        lambda a: a["next_token_ids"].unsqueeze_(0),
        "next_token_ids must be 1-D",
    ),
    (
        "qsl shortened",
        lambda a: a["query_start_loc"].resize_(2),
        "query_start_loc must have num_reqs + 1",
    ),
    (
        "table columns restrided",
        lambda a: a["block_table"].as_strided_((2, 2), (1, 2)),
        "stride(1) == 1",
    ),
    (
        "table rows dropped",
        lambda a: a["block_table"].resize_(1, 2),
        "fewer than num_reqs=2",
    ),
]


@pytest.mark.parametrize(
    ("what", "change", "message"), IN_PLACE, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_buffer_changed_in_place_after_a_cached_call_is_checked_again(
    device, what, change, message
):
    """The same tensor objects, resized, restrided, retyped or moved in place."""
    kwargs = {**_good(device), "out": DFlashInputs.empty(2, 5, 2, device)}
    _call(kwargs)
    _call(kwargs)
    change(kwargs)
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call(kwargs)


@pytest.mark.parametrize(
    ("what", "change", "message"), VALUES, ids=lambda v: v if isinstance(v, str) else ""
)
def test_value_checks_run_on_cached_calls_and_a_refused_call_launches_nothing(
    device, what, change, message
):
    """Value errors (new data in the cached call's tensors, or new tensors of the same
    metadata) raise on a validated call with a cached plan, and leave the buffers as they were."""
    kwargs = {**_good(device), "out": DFlashInputs.empty(2, 5, 2, device)}
    if what == "per-row too large":
        kwargs["num_blocks_per_row"] = torch.tensor([1, 1], dtype=torch.int32, device=device)
    _call(kwargs)
    before = _snapshot(kwargs["out"])
    change(kwargs)
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call(kwargs)
    assert _snapshot(kwargs["out"]) == before
    _call({**kwargs, "validate": False})  # no data read: launches, memory-safe


@pytest.mark.parametrize(
    ("cached", "changed", "message"),
    [
        ({"block_size": 16}, {"block_size": 16.0}, "block_size must be an integer"),
        ({"mask_token_id": 99}, {"mask_token_id": 99.0}, "mask_token_id must be an integer"),
        (
            {"num_speculative_tokens": 1},
            {"num_speculative_tokens": True},
            "num_speculative_tokens must be an integer, got bool",
        ),
        (
            {"max_model_len": 64},
            {"max_model_len": 64.0},
            "max_model_len must be an integer",
        ),
    ],
)
def test_scalars_equal_to_cached_ones_but_of_another_type_are_refused(
    device, cached, changed, message
):
    """16.0 == 16 and True == 1 as dict keys: the signature must not let them through."""
    kwargs = {**_good(device), "num_blocks_per_row": None}
    if "max_model_len" in cached:
        kwargs["num_blocks_per_row"] = torch.tensor([1, 1], dtype=torch.int32, device=device)
    else:
        del kwargs["num_blocks_per_row"]
    kwargs.update(cached)
    out = DFlashInputs.empty(2, 5, kwargs["num_speculative_tokens"], device)
    _call({**kwargs, "out": out})
    _call({**kwargs, "out": out})
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call({**kwargs, **changed, "out": out})


def test_plans_are_bounded_and_belong_to_one_buffer_set(device, checks):
    """At most MAX_PLANS signatures per buffer set, oldest dropped, and at most
    MAX_BATCH_SHAPES batch sizes per plan; narrowed views start with no plans."""
    out = DFlashInputs.empty(4, MAX_BATCH_SHAPES + 10, 2, device)
    table = torch.ones((4, 8), dtype=torch.int32, device=device)
    ids = torch.ones(1, dtype=torch.int32, device=device)
    scalars = {"block_size": 16, "num_speculative_tokens": 2}

    def call(num_ctx: int, mask_token_id: int) -> None:
        positions = torch.arange(num_ctx, dtype=torch.int64, device=device)
        qsl = torch.tensor([0, num_ctx], dtype=torch.int32, device=device)
        expand_dflash_inputs(
            ids, positions, qsl, table, **scalars, mask_token_id=mask_token_id, out=out
        )
        assert out.query_positions[:3].tolist() == [num_ctx, num_ctx + 1, num_ctx + 2]
        assert out.input_ids[:3].tolist() == [1, mask_token_id, mask_token_id]

    for mask_token_id in range(MAX_PLANS + 5):  # the mask id is part of the signature
        call(3, mask_token_id)
        call(3, mask_token_id)
    assert len(out._launch_plans) == MAX_PLANS
    assert checks[0] == MAX_PLANS + 5
    for num_ctx in range(1, MAX_BATCH_SHAPES + 6):  # the batch size is not
        call(num_ctx, 7)
    (plan,) = [p for key, p in out._launch_plans.items() if 7 in key[:4]]
    assert len(plan._shapes) == MAX_BATCH_SHAPES
    assert checks[0] == MAX_PLANS + 5
    narrowed = out.narrow(1, 3)
    assert narrowed._launch_plans == {} and narrowed._launch_plans is not out._launch_plans


def _batch(rng: np.random.Generator, num_reqs: int, num_ctx: int, table: np.ndarray) -> Case:
    """A random batch whose table is (a view of) ``table``: the table's shape is fixed, the
    batch's sizes are not."""
    cuts = np.sort(rng.choice(num_ctx - 1, num_reqs - 1, replace=False) + 1)
    lens = np.diff(np.concatenate([[0], cuts, [num_ctx]]))
    starts = rng.integers(0, 300, num_reqs)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)])
    width = table.shape[1] - 1
    return Case(
        next_token_ids=rng.integers(0, 150_000, num_reqs).astype(np.int32),
        target_positions=positions.astype(np.int64),
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        block_table=table,
        table_rows=num_reqs + int(rng.integers(0, 2)),
        table_width=width,
        num_speculative_tokens=4,
        block_size=16,
        mask_token_id=151_000,
        num_rejected_tokens=np.minimum(rng.integers(0, 5, num_reqs), lens - 1).astype(np.int32),
        num_blocks_per_row=rng.integers(0, width + 1, num_reqs).astype(np.int32),
        max_model_len=400,
    )


@pytest.mark.parametrize("validate", [True, False])
def test_batches_of_any_size_that_fits_share_one_plan(device, seeded_rng, checks, validate):
    """An engine's batch changes size every step: one check for the buffers' first call, then
    every batch that fits them launches the same plan, each result equal to the oracle's."""
    seed, rng = seeded_rng
    table = rng.integers(0, 5000, (70, 30)).astype(np.int32)
    out = DFlashInputs.empty(64, 600, 4, device)
    for step in range(12):
        num_reqs = int(rng.integers(2, 65))
        case = _batch(rng, num_reqs, int(rng.integers(num_reqs, 601)), table)
        case.extra_reqs, case.extra_ctx = 64 - case.num_reqs, 600 - case.num_ctx
        case.seed = seed
        positional, keywords = case.torch_args(device)
        poison(out)
        expand_dflash_inputs(*positional, **keywords, out=out, validate=validate)
        assert_matches(out, oracle(case), case, f"batch {step}")
    assert checks[0] == 1
    assert len(out._launch_plans) == 1


# (name, the batch after a cached call of 2 requests and 5 tokens, expected message fragment)
GROWN = [
    ("more requests than out holds", (3, 6), "out holds 2 requests, fewer than num_reqs=3"),
    ("more tokens than out holds", (2, 6), "out holds 5 context lanes, fewer than 6"),
]


@pytest.mark.parametrize(
    ("what", "sizes", "message"), GROWN, ids=lambda v: v if isinstance(v, str) else ""
)
def test_a_batch_that_outgrows_the_buffers_is_refused(device, what, sizes, message):
    num_reqs, num_ctx = sizes
    kwargs = {**_good(device), "out": DFlashInputs.empty(2, 5, 2, device)}
    _call(kwargs)
    _call(kwargs)
    grown = {
        **kwargs,
        "next_token_ids": torch.arange(num_reqs, dtype=torch.int32, device=device),
        "target_positions": torch.arange(num_ctx, dtype=torch.int64, device=device),
        "query_start_loc": torch.tensor(
            [0, *range(num_ctx - num_reqs + 1, num_ctx + 1)], dtype=torch.int32, device=device
        ),
        "block_table": torch.ones((num_reqs, 2), dtype=torch.int32, device=device),
    }
    before = _snapshot(kwargs["out"])
    with pytest.raises(InvalidArgumentError, match=_escape(message)):
        _call(grown)
    assert _snapshot(kwargs["out"]) == before


def test_a_table_with_overlapping_rows_is_refused_once_it_has_two(device):
    """One row may have any row stride; two may not overlap. A cached one-row call with such
    a table does not let a two-row call with the same strides through."""
    base = torch.arange(1, 9, dtype=torch.int32, device=device)
    one = {
        "next_token_ids": torch.tensor([7], dtype=torch.int32, device=device),
        "target_positions": torch.tensor([0, 1, 2], dtype=torch.int64, device=device),
        "query_start_loc": torch.tensor([0, 3], dtype=torch.int32, device=device),
        "block_table": base.as_strided((1, 4), (1, 1)),
        "block_size": 16,
        "num_speculative_tokens": 2,
        "mask_token_id": 99,
        "out": DFlashInputs.empty(2, 5, 2, device),
    }
    _call(one)
    _call(one)
    two = {**_good(device), "block_table": base.as_strided((2, 4), (1, 1)), "out": one["out"]}
    with pytest.raises(InvalidArgumentError, match="row stride 1 is smaller than its width 4"):
        _call(two)


def test_reference_backend_and_calls_without_out_keep_no_plans(device, checks):
    kwargs = _good(device)
    out = DFlashInputs.empty(2, 5, 2, device)
    for _ in range(2):
        _call({**kwargs, "out": out, "backend": "reference"})
        _call(kwargs)
    assert out._launch_plans == {}
    assert checks[0] == 4


def test_a_cpu_plan_is_not_used_once_the_interpreter_is_off(monkeypatch):
    """A plan made under TRITON_INTERPRET=1 on CPU tensors: with the variable unset, 'auto' runs
    the reference again and 'triton' refuses, as without a plan."""
    if torch.cuda.is_available():
        pytest.skip("CPU tensors run the kernel only under the interpreter")
    from dflash_rs.kernels.dflash_expand import ExpandLaunch

    kwargs = {**_good("cpu"), "out": DFlashInputs.empty(2, 5, 2, "cpu")}
    _call(kwargs)
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    def refuse(self, tensors, pointers):
        raise AssertionError("the cached plan must not launch")

    monkeypatch.setattr(ExpandLaunch, "launch", refuse)
    result = _call(kwargs)
    assert result.query_positions[:3].tolist() == [3, 4, 5]
    with pytest.raises(InvalidArgumentError, match="backend='triton' needs CUDA tensors"):
        _call({**kwargs, "backend": "triton"})


def test_the_launch_paths_pass_the_buffers_in_field_order():
    """The per-call paths read ``out``'s buffers one by one: they must follow ``BUFFER_NAMES``."""
    out = DFlashInputs.empty(2, 5, 2, "cpu")
    args = prepare_expand_args(**{**_good("cpu"), "out": out})
    buffers = buffer_tensors(out)
    assert [f.name for f in dataclasses.fields(DFlashInputs) if f.name in BUFFER_NAMES] == list(
        BUFFER_NAMES
    )
    assert [id(t) for t in kernel_tensors(args)[6:]] == [id(t) for t in buffers]
    plan_args = call_signature(
        args.next_token_ids, args.target_positions, args.query_start_loc, args.block_table,
        None, None, out, 16, 2, 99, None, False, "triton",
    )  # fmt: skip
    assert plan_args is not None
    _, tensors, _, _ = plan_args
    assert [id(t) for t in tensors[6:]] == [id(t) for t in buffers]
