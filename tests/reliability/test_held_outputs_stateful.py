"""Stateful test of the held-output contract (issue 16): whatever the engine does, every
``SchedulerOutput`` it still holds reads exactly as when ``schedule()`` returned it.

Rules, in random interleavings on a tiny pool (sync, or async with up to two steps in flight):
submit requests (shared prefixes, so prefix hits), schedule, apply the oldest step's output,
abandon the oldest step in flight (a lost output: the younger ones go with it), abort (in
flight too), preempt everything, pause and unpause, reset the prefix cache (also preempting
the running requests), install drafts, and let go of held outputs (so their block-table
snapshots are reused). Every output ever returned is kept for a while.

After every rule: each held output equals its deep copy taken at return time (every array,
tuple, set, dict and per-request record it exposes), ``check_invariants()`` holds, and the pool
accounts for every block. At return time the block-table rows were exactly the blocks each
request owned (``block_ids``).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from typing import Any, Deque, List, Optional, Tuple

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig
from dflash_rs.errors import SchedulerStateError
from scheduler.drivers import sampled_for
from scheduler.test_held_outputs import assert_unchanged, frozen_view

VOCAB = 12
MAX_MODEL_LEN = 24
#: Held outputs kept at most (older ones are let go, oldest first).
MAX_HELD = 10
SEEN: Counter = Counter()


class HeldOutputsMachine(RuleBasedStateMachine):
    """One scheduler, the steps in flight, and every output the engine still holds."""

    def __init__(self) -> None:
        super().__init__()
        self.sched: Optional[Scheduler] = None
        self.in_flight: Deque[Any] = deque()
        self.held: List[Tuple[Any, dict]] = []
        self.next_id = 0
        self.rng = random.Random(0)

    @initialize(
        method=st.sampled_from([None, "dflash", "eagle", "ngram"]),
        k=st.integers(1, 3),
        block_size=st.sampled_from([1, 2, 4]),
        spare_blocks=st.integers(0, 16),
        async_scheduling=st.booleans(),
        chunked=st.booleans(),
        seed=st.integers(0, 2**16),
    )
    def setup(
        self,
        method: Optional[str],
        k: int,
        block_size: int,
        spare_blocks: int,
        async_scheduling: bool,
        chunked: bool,
        seed: int,
    ) -> None:
        self.async_scheduling = async_scheduling
        self.method = method
        self.k = k
        # The pool holds one max_model_len request with its lookahead (and the null block),
        # plus a few spare blocks: small enough to preempt.
        num_blocks = -(-(MAX_MODEL_LEN + k + 1) // block_size) + 1 + spare_blocks
        self.num_blocks = num_blocks
        self.rng = random.Random(seed)
        self.sched = Scheduler(
            SchedulerConfig(
                num_blocks,
                block_size=block_size,
                max_model_len=MAX_MODEL_LEN,
                max_num_seqs=4,
                max_num_batched_tokens=24 if not chunked else 8,
                enable_chunked_prefill=chunked,
                speculative=None if method is None else SpeculativeConfig(method, k),
                async_scheduling=async_scheduling,
            )
        )

    @property
    def s(self) -> Scheduler:
        assert self.sched is not None
        return self.sched

    @property
    def max_in_flight(self) -> int:
        return 2 if self.async_scheduling else 1

    # ---- rules --------------------------------------------------------------------------

    @rule(n=st.integers(1, 3), shared=st.booleans())
    def submit(self, n: int, shared: bool) -> None:
        for _ in range(n):
            rid = f"r{self.next_id}"
            self.next_id += 1
            length = self.rng.randint(1, 12)
            prefix = [1, 2, 3, 4, 5, 6] if shared else []
            prompt = (prefix + [self.rng.randrange(VOCAB) for _ in range(length)])[:16]
            self.s.add_request(Request(rid, prompt, self.rng.randint(1, 6), eos_token_id=0))

    @precondition(lambda self: self.sched is not None)
    @rule()
    def schedule(self) -> None:
        if len(self.in_flight) >= self.max_in_flight:
            return
        self.do_schedule()

    @precondition(lambda self: self.sched is not None)
    @rule(steps=st.integers(1, 6), accept=st.sampled_from(["random", "all", "none"]))
    def run_steps(self, steps: int, accept: str) -> None:
        """A few engine steps in a row (async: keeps two in flight)."""
        for _ in range(steps):
            if len(self.in_flight) >= self.max_in_flight:
                self.apply_oldest(accept, False)
            self.do_schedule()

    def do_schedule(self) -> None:
        out = self.s.schedule()
        # Half the tables are read at once, the rest at a later rule (frozen then).
        read_now = self.rng.random() < 0.5
        self.held.append((out, frozen_view(out, None if read_now else self.s)))
        del self.held[:-MAX_HELD]
        if out.req_ids:
            self.in_flight.append(out)
            SEEN[f"in flight: {len(self.in_flight)}"] += 1
        else:
            self.s.update_from_output(out, ModelRunnerOutput([], []))
        SEEN["preempted"] += len(out.preempted_req_ids)
        SEEN["prefix hits"] += sum(r.num_computed_tokens > 0 for r in out.scheduled_new_reqs)

    @precondition(lambda self: self.sched is not None and bool(self.in_flight))
    @rule(accept=st.sampled_from(["random", "all", "none"]), eos=st.booleans())
    def apply_oldest(self, accept: str, eos: bool) -> None:
        out = self.in_flight.popleft()
        sampled = sampled_for(out, self.rng, accept=accept, vocab=VOCAB)
        if eos:
            sampled = [[*s[:-1], 0] if s else s for s in sampled]
        results = self.s.update_from_output(out, ModelRunnerOutput(list(out.req_ids), sampled))
        SEEN["finished by output"] += sum(r.finished for r in results)

    @precondition(lambda self: self.sched is not None and bool(self.in_flight))
    @rule(reapply=st.booleans())
    def abandon_oldest(self, reapply: bool) -> None:
        """The runner raised: the oldest step and the younger ones built on it are abandoned."""
        out = self.in_flight.popleft()
        assert self.s.abandon_step(out) == 1 + len(self.in_flight)
        self.in_flight.clear()
        if reapply:
            with pytest.raises(SchedulerStateError):
                self.s.update_from_output(out, ModelRunnerOutput(list(out.req_ids), []))
        SEEN["abandoned"] += 1

    @precondition(lambda self: self.sched is not None and self.method is not None)
    @rule()
    def drafts(self) -> None:
        running = self.s.running_request_ids()
        drafts = {
            rid: [self.rng.randrange(1, VOCAB) for _ in range(self.rng.randint(0, self.k))]
            for rid in running
        }
        self.s.update_draft_token_ids(drafts)

    @precondition(lambda self: self.sched is not None)
    @rule(in_flight=st.booleans(), skip=st.integers(0, 2))
    def abort(self, in_flight: bool, skip: int) -> None:
        if skip:
            return
        pool = self.s.running_request_ids() + self.s.waiting_request_ids()
        if in_flight and self.in_flight:
            pool = [r for r in self.in_flight[0].req_ids if self.s.has_request(r)] or pool
        if pool:
            self.s.finish_requests(self.rng.choice(pool))
            SEEN["aborted"] += 1

    @precondition(lambda self: self.sched is not None and not self.in_flight)
    @rule()
    def preempt_all(self) -> None:
        SEEN["preempt all"] += len(self.s.preempt_all_running(drop_stale_outputs=False))

    @precondition(lambda self: self.sched is not None)
    @rule(running=st.booleans(), skip=st.integers(0, 4))
    def reset_prefix_cache(self, running: bool, skip: int) -> None:
        if skip:
            return
        self.s.reset_prefix_cache(reset_running_requests=running)
        SEEN["reset"] += 1

    @precondition(lambda self: self.sched is not None)
    @rule(state=st.sampled_from(["unpaused", "unpaused", "paused_new", "paused_all"]))
    def pause(self, state: str) -> None:
        self.s.set_pause_state(state)

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def let_go(self, data: Any) -> None:
        """The engine drops one held output (its snapshot is reused by a later step)."""
        self.held.pop(data.draw(st.integers(0, len(self.held) - 1), label="let go"))
        SEEN["let go"] += 1

    # ---- invariants ---------------------------------------------------------------------

    @invariant()
    def held_outputs_read_as_returned(self) -> None:
        for out, expected in self.held:
            assert_unchanged(out, expected, "a later call")

    @invariant()
    def pool_and_ownership(self) -> None:
        if self.sched is None:
            return
        self.s.check_invariants()
        assert 0 <= self.s.num_free_blocks <= self.num_blocks - 1

    def teardown(self) -> None:
        if self.sched is None:
            return
        while self.in_flight:
            self.apply_oldest("none", False)
        self.s.finish_requests(self.s.running_request_ids() + self.s.waiting_request_ids())
        out = self.s.schedule()
        self.s.update_from_output(out, ModelRunnerOutput([], []))
        self.held_outputs_read_as_returned()
        assert self.s.num_free_blocks == self.num_blocks - 1, "blocks leaked"


COVERED = ("in flight: 2", "preempted", "prefix hits", "aborted", "reset", "let go", "abandoned")


def _run(**kwargs: Any) -> List[str]:
    """One run of the machine; returns what it did not cover."""
    run_state_machine_as_test(
        HeldOutputsMachine,
        settings=settings(
            max_examples=120,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            **kwargs,
        ),
    )
    return [what for what in COVERED if SEEN[what] == 0]


def test_held_outputs_never_change() -> None:
    """Fresh sequences every run; should one miss a rare event, a derandomized run (the same
    sequences every time) covers it, so the coverage check never fails by chance."""
    SEEN.clear()
    if _run():
        assert not _run(derandomize=True), f"the runs never covered some events: {dict(SEEN)}"
