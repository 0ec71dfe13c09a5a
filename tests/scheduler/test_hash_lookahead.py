"""Lookahead block hashes (``SchedulerConfig.hash_lookahead_tokens``, vLLM 0.33's default for
EAGLE-style drafters): each block's hash also covers the tokens after it, so a prefix hit needs
the same next tokens, and a block becomes reusable only once they exist. The EAGLE block drop
(``drop_last_hit_block``) gives up the last hit block instead; the two exclude each other."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from dflash_rs.errors import InvalidArgumentError

BS = 16
PROMPT = list(range(100, 100 + 3 * BS + 1))  # three full blocks and one token


def _scheduler(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=64, block_size=BS, max_model_len=512, **kw))


def _serve(s: Scheduler, request: Request) -> int:
    """Serves ``request`` to the end; returns the tokens its first step took from the prefix
    cache."""
    s.add_request(request)
    first = True
    hit = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        if first:
            hit = len(request.prompt_token_ids) - out.num_scheduled_tokens[request.request_id]
            first = False
        s.check_invariants()
        s.update_from_output(
            out, ModelRunnerOutput(out.req_ids, [[] if c else [7] for c in out.is_prefill_chunk])
        )
    return hit


@pytest.mark.parametrize(
    ("config", "same_next", "other_next"),
    [
        ({}, 3 * BS, 3 * BS),  # blocks alone: the next token does not matter
        ({"hash_lookahead_tokens": 1}, 3 * BS, 2 * BS),  # block 2's hash covers token 48
        ({"drop_last_hit_block": True}, 2 * BS, 2 * BS),  # the last hit block is recomputed
    ],
    ids=["plain", "lookahead", "drop"],
)
def test_a_hit_needs_the_same_next_token_only_with_lookahead_hashes(
    config: dict[str, object], same_next: int, other_next: int
) -> None:
    s = _scheduler(**config)
    assert _serve(s, Request("a", PROMPT, 1)) == 0
    assert _serve(s, Request("same", PROMPT, 1)) == same_next
    other = [*PROMPT[: 3 * BS], 99]
    assert _serve(s, Request("other", other, 1)) == other_next


def test_a_block_is_reusable_once_its_next_token_exists() -> None:
    # "a" holds exactly two blocks: block 1's next token arrives only as a's output.
    s = _scheduler(hash_lookahead_tokens=1)
    prompt = list(range(200, 200 + 2 * BS))
    _serve(s, Request("a", prompt, 3))
    # Block 1 was cached once a's first output (7) existed: a prompt continuing with 7 hits it.
    assert _serve(s, Request("b", [*prompt, 7, 8], 1)) == 2 * BS
    # Another continuation shares only block 0.
    assert _serve(s, Request("c", [*prompt, 9, 8], 1)) == BS


def test_config_checks() -> None:
    base = SchedulerConfig(num_blocks=64, block_size=BS, max_model_len=512)
    assert base.hash_lookahead_tokens == 0
    with pytest.raises(InvalidArgumentError, match="exclude each other"):
        dataclasses.replace(base, hash_lookahead_tokens=1, drop_last_hit_block=True)
    with pytest.raises(InvalidArgumentError, match="hash_lookahead_tokens"):
        dataclasses.replace(base, hash_lookahead_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="hash_lookahead_tokens 65 is above 64"):
        dataclasses.replace(base, hash_lookahead_tokens=65)
    with pytest.raises(TypeError, match="hash_lookahead_tokens"):
        dataclasses.replace(base, hash_lookahead_tokens="1")  # type: ignore[arg-type]
