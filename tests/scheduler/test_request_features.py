"""The per-request features the vLLM drop-in maps onto the core, through the Python API:
``Request.lora_id`` with ``SchedulerConfig.max_loras``, ``skip_reading_prefix_cache`` and
``prompt_embed_hashes``; bad values raise typed errors and leave the scheduler as it was."""

from __future__ import annotations

import pytest

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig
from dflash_rs.errors import ArgumentTypeError, InvalidArgumentError

BS = 16


def _scheduler(**kw: object) -> Scheduler:
    return Scheduler(SchedulerConfig(num_blocks=200, block_size=BS, max_model_len=512, **kw))


def _finish_prefills(s: Scheduler) -> None:
    out = s.schedule()
    s.update_from_output(
        out, ModelRunnerOutput(out.req_ids, [[] if c else [7] for c in out.is_prefill_chunk])
    )


def test_max_loras_passes_over_a_request_with_one_adapter_too_many() -> None:
    s = _scheduler(max_loras=2)
    for i, lora in enumerate([1, 2, 3, None, 1]):
        s.add_request(Request(f"r{i}", list(range(100 * i, 100 * i + 20)), 4, lora_id=lora))
    out = s.schedule()
    assert sorted(out.req_ids) == ["r0", "r1", "r3", "r4"]
    assert s.get_request_counts() == (4, 1)


def test_skip_reading_prefix_cache_gets_no_hit() -> None:
    s = _scheduler()
    prompt = list(range(500, 500 + 3 * BS + 2))
    s.add_request(Request("a", prompt, 4))
    _finish_prefills(s)
    s.add_request(Request("skip", prompt, 4, skip_reading_prefix_cache=True))
    s.add_request(Request("hit", prompt, 4))
    out = s.schedule()
    computed = dict(zip(out.req_ids, out.num_computed_tokens))
    assert computed["skip"] == 0 and computed["hit"] == 3 * BS


def test_prompt_embed_hashes_key_the_blocks() -> None:
    s = _scheduler()
    zeros = [0] * (3 * BS + 2)
    digests = [bytes([d]) * 32 for d in (1, 2, 3, 4)]
    s.add_request(Request("a", zeros, 4, prompt_embed_hashes=digests))
    _finish_prefills(s)
    other = [digests[0], bytes([9]) * 32, *digests[2:]]
    s.add_request(Request("b", zeros, 4, prompt_embed_hashes=other))
    s.add_request(Request("c", zeros, 4, prompt_embed_hashes=digests))
    s.add_request(Request("tokens", zeros, 4))
    out = s.schedule()
    computed = dict(zip(out.req_ids, out.num_computed_tokens))
    del computed["a"]  # decoding
    assert computed == {"b": BS, "c": 3 * BS, "tokens": 0}


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"lora_id": 0}, InvalidArgumentError),
        ({"lora_id": 2**31}, InvalidArgumentError),
        ({"lora_id": "1"}, ArgumentTypeError),
        ({"skip_reading_prefix_cache": 1}, ArgumentTypeError),
    ],
)
def test_bad_request_fields_are_refused(kwargs: dict[str, object], error: type) -> None:
    with pytest.raises(error):
        Request("r", [1, 2, 3], 4, **kwargs)


@pytest.mark.parametrize(
    "digests,error",
    [
        ([b"x" * 31], InvalidArgumentError),
        (["not bytes"], ArgumentTypeError),
        (7, ArgumentTypeError),
    ],
)
def test_bad_prompt_embed_hashes_leave_the_scheduler_unchanged(
    digests: object, error: type
) -> None:
    s = _scheduler()
    s.add_request(Request("ok", [1, 2, 3], 4))
    with pytest.raises(error):
        s.add_request(Request("bad", [0] * 20, 4, prompt_embed_hashes=digests))  # type: ignore[arg-type]
    assert s.get_num_unfinished_requests() == 1
    assert list(s.schedule().req_ids) == ["ok"]


def test_bad_max_loras_is_refused() -> None:
    with pytest.raises(InvalidArgumentError):
        _scheduler(max_loras=-1)
