"""The README's list/dict API reads what engines pass in one pass: exact lists (or tuples) of
exact ints, and drafts keyed by the scheduler's own id strs (the items of ``req_ids``); any other
input is read item by item. Two schedulers driven by the same random steps, one given the
one-pass shapes and one given a random mix of every other shape (numpy arrays, int subclasses,
copies of the id strs, a dict subclass, shapes that change mid-list), return the same outputs
and drafts and end in the same state. RequestOutputs read as returned however many are made
after them, and hold any number of tokens."""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any, Dict, List, Sequence

import numpy as np
import pytest

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig

K = 4


class Token(int):
    """An int subclass: a valid token that the one-pass read leaves to the general path."""


class Drafts(dict):
    """A dict subclass: read through its items, as any dict that is not exactly a dict."""


class DraftMapping(Mapping):
    """A ``Mapping`` that is no dict at all: copied to a dict, then read as one."""

    def __init__(self, items: Dict[str, Any]) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def _config(k: int = K) -> SchedulerConfig:
    return SchedulerConfig(
        num_blocks=160,
        block_size=16,
        max_model_len=512,
        max_num_seqs=12,
        max_num_batched_tokens=256,
        speculative=SpeculativeConfig("dflash", k),
    )


def _copy(rid: str) -> str:
    """An equal str that is not the scheduler's object (one-character strs are singletons)."""
    return (rid + "\0")[:-1]


def _other_shape(tokens: List[int], rng: random.Random) -> Any:
    shape = rng.randrange(5)
    if shape == 0:
        return np.asarray(tokens, dtype=np.int64)
    if shape == 1:
        return tuple(Token(t) for t in tokens)
    if shape == 2:
        return [np.int32(t) for t in tokens]
    if shape == 3:
        return tuple(tokens)  # an exact tuple: read in one pass too
    return list(tokens)


def _sampled_shape(sampled: List[List[int]], rng: random.Random) -> Sequence[Any]:
    rows = [_other_shape(t, rng) for t in sampled]
    return tuple(rows) if rng.random() < 0.3 else rows


def _outputs(outs) -> list:
    return [(o.request_id, o.new_token_ids, o.finish_reason, o.stop_reason) for o in outs]


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_and_general_reads_agree(seed: int) -> None:
    rng = random.Random(seed)
    fast, general = Scheduler(_config()), Scheduler(_config())
    ids = [f"r{i}" for i in range(16)]
    held: list = []  # every output of `fast`, with what it read when returned
    next_id = 0
    steps = 0
    while steps < 80:
        steps += 1
        # Arrivals, reusing the ids of finished requests (new slots, or the same slot).
        while next_id < len(ids) * 3 and rng.random() < 0.5:
            rid = ids[next_id % len(ids)]
            next_id += 1
            if fast.has_request(rid):
                continue
            prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 60))]
            req = dict(max_tokens=rng.randrange(1, 30), eos_token_id=7, stop_token_ids=[9])
            for s in (fast, general):
                s.add_request(Request(rid, prompt, **req))
        if not fast.has_unfinished_requests():
            continue
        a, b = fast.schedule(), general.schedule()
        assert a.req_ids == b.req_ids
        spec = a.scheduled_spec_decode_tokens
        assert spec == b.scheduled_spec_decode_tokens
        sampled = []
        for i, rid in enumerate(a.req_ids):
            if a.is_prefill_chunk[i]:
                sampled.append([])
                continue
            drafts = spec.get(rid, [])
            accepted = rng.randrange(len(drafts) + 1)
            sampled.append([*drafts[:accepted], rng.randrange(3, 60)])
        runner_drafts = None
        if rng.random() < 0.3:
            runner_drafts = [
                [rng.randrange(3, 60) for _ in range(rng.randrange(K + 1))] for _ in a.req_ids
            ]
        general_drafts = None
        if runner_drafts is not None:
            general_drafts = [_other_shape(d, rng) for d in runner_drafts]
        outs_a = fast.update_from_output(
            a, ModelRunnerOutput(a.req_ids, sampled, draft_token_ids=runner_drafts)
        )
        outs_b = general.update_from_output(
            b,
            ModelRunnerOutput(
                list(b.req_ids), _sampled_shape(sampled, rng), draft_token_ids=general_drafts
            ),
        )
        assert _outputs(outs_a) == _outputs(outs_b)
        held.append((outs_a, _outputs(outs_a)))
        if runner_drafts is None:
            keys = [*list(a.req_ids), "unknown", ids[rng.randrange(len(ids))]]
            drafts = {
                rid: [rng.randrange(3, 60) for _ in range(rng.randrange(K + 1))]
                for rid in rng.sample(keys, rng.randrange(len(keys) + 1))
            }
            other = {
                _copy(r) if rng.random() < 0.5 else r: _other_shape(d, rng)
                for r, d in drafts.items()
            }
            shape = rng.random()
            if shape < 0.2:
                other = Drafts(other)
            elif shape < 0.3:
                other = DraftMapping(other)
            elif shape < 0.4:
                other = MappingProxyType(other)
            assert fast.update_draft_token_ids(drafts) == general.update_draft_token_ids(other)
        if rng.random() < 0.05 and a.req_ids:
            victim = a.req_ids[rng.randrange(len(a.req_ids))]
            assert fast.finish_requests(victim) == general.finish_requests(_copy(victim))
        for rid in set(ids):
            assert fast.has_request(rid) == general.has_request(rid)
            if fast.has_request(rid):
                assert fast.all_token_ids(rid) == general.all_token_ids(rid)
    fast.check_invariants()
    general.check_invariants()
    assert fast.stats() == general.stats()
    for outs, as_returned in held:
        assert _outputs(outs) == as_returned


def test_drafts_keyed_by_an_id_str_of_an_earlier_request_go_to_the_request_of_that_id() -> None:
    s = Scheduler(_config())
    s.add_request(Request("aa", [1, 2, 3], 1))
    first = s.schedule()
    old_id = first.req_ids[0]
    (out,) = s.update_from_output(first, ModelRunnerOutput(first.req_ids, [[5]]))
    assert out.finish_reason == "length"
    s.add_request(Request("b", [4, 5, 6], 10))
    s.add_request(Request("aa", [1, 2, 3, 4], 10))
    step = s.schedule()
    s.update_from_output(step, ModelRunnerOutput(step.req_ids, [[6], [8]]))
    assert all(r is not old_id for r in step.req_ids)
    assert s.update_draft_token_ids({old_id: [11, 12], _copy("b"): [13]}) == 2
    assert s.schedule().scheduled_spec_decode_tokens == {"b": [13], "aa": [11, 12]}


def test_request_outputs_hold_more_tokens_than_fit_inline() -> None:
    k = 20
    s = Scheduler(_config(k))
    s.add_request(Request("a", list(range(3, 40)), 200))
    step = s.schedule()
    s.update_from_output(step, ModelRunnerOutput(step.req_ids, [[41]]))
    drafts = list(range(100, 100 + k))
    assert s.update_draft_token_ids({"a": drafts}) == 1
    step = s.schedule()
    assert step.scheduled_spec_decode_tokens == {"a": drafts}
    (out,) = s.update_from_output(step, ModelRunnerOutput(step.req_ids, [[*drafts, 7]]))
    assert out.new_token_ids == [*drafts, 7] and out.finish_reason is None
    assert repr(out).startswith("RequestOutput(request_id=a, new_token_ids=[100, 101,")


def test_request_outputs_read_as_returned_while_later_ones_reuse_freed_objects() -> None:
    s = Scheduler(_config())
    for i in range(8):
        s.add_request(Request(f"r{i}", [3 + i] * 20, 50))
    rng = random.Random(0)
    kept: Dict[int, tuple] = {}
    for step_no in range(12):
        step = s.schedule()
        spec = step.scheduled_spec_decode_tokens
        sampled = [
            [*spec.get(r, [])[: rng.randrange(K + 1)], rng.randrange(3, 60)] for r in step.req_ids
        ]
        outs = s.update_from_output(step, ModelRunnerOutput(step.req_ids, sampled))
        assert [o.new_token_ids for o in outs] == sampled
        if step_no % 3 == 0:
            kept[step_no] = (outs, _outputs(outs))
        s.update_draft_token_ids(
            {r: [rng.randrange(3, 60) for _ in range(K)] for r in step.req_ids}
        )
    for outs, as_returned in kept.values():
        assert _outputs(outs) == as_returned
