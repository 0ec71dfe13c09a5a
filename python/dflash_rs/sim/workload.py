"""Seeded request workload: conversations that share system prompts and continue over turns.

Each conversation belongs to a tenant (cache salt ``None`` or a tenant name), usually starts with
one of a few shared system prompts, and has one or more turns. Turn ``t + 1``'s prompt is turn
``t``'s prompt and output plus a new user message, so it hits the prefix cache on everything the
previous turn computed. First turns arrive by a Poisson process counted in model steps (rate
``arrival_rate`` per step; 0 = all at step 0); a later turn arrives a few steps after the
previous one finishes. Lengths are drawn uniformly from inclusive ranges, so prompt lengths fall
at every offset inside a block, and ``prompt_len + K + 1`` often crosses a block boundary.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, cast

import numpy as np

from dflash_rs.request import Request

__all__ = ["EOS_TOKEN_ID", "MASK_TOKEN_ID", "Workload", "WorkloadConfig"]

EOS_TOKEN_ID = 2
MASK_TOKEN_ID = 1
"""DFlash's parallel-drafting (mask) token id."""
FIRST_TEXT_TOKEN = 3

LengthRange = Tuple[int, int]


@dataclass(frozen=True)
class WorkloadConfig:
    """Shape of the request stream. Lengths are inclusive ``(min, max)`` ranges, in tokens."""

    num_requests: int = 300
    seed: int = 0
    arrival_rate: float = 0.0
    max_model_len: int = 4096
    vocab_size: int = 32000
    num_system_prompts: int = 4
    system_prompt_len: LengthRange = (16, 320)
    no_system_prompt_prob: float = 0.15
    user_len: LengthRange = (4, 160)
    output_len: LengthRange = (8, 160)
    max_turns: int = 3
    think_steps: LengthRange = (1, 8)
    tenants: Sequence[Optional[str]] = (None, None, None, "tenant-b")
    num_priorities: int = 3

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError("num_requests must be >= 1")
        if self.arrival_rate < 0:
            raise ValueError("arrival_rate must be >= 0 (0 = all requests at once)")
        for name in ("system_prompt_len", "user_len", "output_len", "think_steps"):
            low, high = getattr(self, name)
            if not 0 <= low <= high:
                raise ValueError(f"{name} must be a (min, max) range with 0 <= min <= max")
        if self.user_len[0] < 1 or self.output_len[0] < 1:
            raise ValueError("user_len and output_len must be at least 1 token")
        if self.max_turns < 1 or self.num_priorities < 1 or not self.tenants:
            raise ValueError("max_turns, num_priorities and tenants must be non-empty")


@dataclass
class _Conversation:
    index: int
    tenant: Optional[str]
    system_prompt: int  # -1: none
    priority: int
    turns_left: int
    turn: int = 0


@dataclass(order=True)
class _Arrival:
    step: int
    seq: int
    request: Request = field(compare=False)
    conversation: int = field(compare=False)


class Workload:
    """The request stream: ``due(step)`` returns the requests that arrive by ``step``, and
    ``on_finished`` turns a finished turn into its conversation's next turn."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._np_rng = np.random.default_rng(config.seed)
        self._system_prompts = [
            self._tokens(self._length(config.system_prompt_len))
            for _ in range(config.num_system_prompts)
        ]
        self._conversations: Dict[int, _Conversation] = {}
        self._conversation_of: Dict[str, int] = {}
        self._arrivals: List[_Arrival] = []
        self._seq = 0
        self._clock = 0.0
        self.num_created = 0
        self.num_continuations = 0
        # Plan conversations' first turns until their planned turns use up the budget.
        planned = 0
        while planned < config.num_requests:
            turns = min(self._rng.randint(1, config.max_turns), config.num_requests - planned)
            planned += turns
            self._start_conversation(turns)

    # -- random helpers -------------------------------------------------------------------

    def _length(self, bounds: LengthRange) -> int:
        return self._rng.randint(bounds[0], bounds[1])

    def _tokens(self, n: int) -> np.ndarray:
        high = self.config.vocab_size
        return self._np_rng.integers(FIRST_TEXT_TOKEN, high, size=n, dtype=np.int64).astype(
            np.int32
        )

    def _next_arrival_time(self) -> float:
        if self.config.arrival_rate > 0:
            self._clock += self._rng.expovariate(self.config.arrival_rate)
        return self._clock

    # -- conversations --------------------------------------------------------------------

    def _start_conversation(self, turns: int, step: Optional[int] = None) -> None:
        cfg = self.config
        index = len(self._conversations)
        has_system = bool(self._system_prompts) and self._rng.random() >= cfg.no_system_prompt_prob
        conv = _Conversation(
            index=index,
            tenant=self._rng.choice(list(cfg.tenants)),
            system_prompt=self._rng.randrange(len(self._system_prompts)) if has_system else -1,
            priority=self._rng.randrange(cfg.num_priorities),
            turns_left=turns,
        )
        self._conversations[index] = conv
        prefix = self._system_prompts[conv.system_prompt] if has_system else None
        prompt = self._tokens(self._length(cfg.user_len))
        if prefix is not None:
            prompt = np.concatenate([prefix, prompt])
        arrival = int(self._next_arrival_time()) if step is None else step
        self._add_turn(conv, prompt[: cfg.max_model_len - 1], arrival)

    def _add_turn(self, conv: _Conversation, prompt: np.ndarray, step: int) -> None:
        cfg = self.config
        request_id = f"c{conv.index}-t{conv.turn}"
        max_tokens = max(1, min(self._length(cfg.output_len), cfg.max_model_len - len(prompt)))
        request = Request(
            request_id,
            cast(Sequence[int], prompt),  # an int32 array: checked in Rust without a Python loop
            max_tokens,
            eos_token_id=EOS_TOKEN_ID,
            priority=conv.priority,
            arrival_time=float(step),
            cache_salt=conv.tenant,
        )
        conv.turns_left -= 1
        conv.turn += 1
        self.num_created += 1
        self._conversation_of[request_id] = conv.index
        heapq.heappush(self._arrivals, _Arrival(step, self._seq, request, conv.index))
        self._seq += 1

    def on_finished(self, request_id: str, all_token_ids: Sequence[int], step: int) -> None:
        """Schedule the conversation's next turn (prompt: everything so far + a user message)."""
        conv = self._conversations[self._conversation_of.pop(request_id)]
        if conv.turns_left <= 0:
            return
        arrival = step + self._length(self.config.think_steps)
        history = np.asarray(all_token_ids, dtype=np.int32)
        prompt = np.concatenate([history, self._tokens(self._length(self.config.user_len))])
        if len(prompt) >= self.config.max_model_len - 1:
            # Too long to continue: a new conversation takes over the remaining turns.
            turns, conv.turns_left = conv.turns_left, 0
            self._start_conversation(turns, step=arrival)
            return
        self.num_continuations += 1
        self._add_turn(conv, prompt, arrival)

    # -- the stream -----------------------------------------------------------------------

    def due(self, step: int) -> List[Request]:
        """Requests arriving at or before ``step``, in arrival order."""
        ready = []
        while self._arrivals and self._arrivals[0].step <= step:
            ready.append(heapq.heappop(self._arrivals).request)
        return ready

    def next_arrival_step(self) -> Optional[int]:
        """Step of the next pending arrival, or None when none is pending."""
        return self._arrivals[0].step if self._arrivals else None

    @property
    def num_pending(self) -> int:
        """Requests created but not yet arrived."""
        return len(self._arrivals)

    @property
    def exhausted(self) -> bool:
        """No request is pending and no conversation can add another turn."""
        return not self._arrivals and not self._conversation_of
