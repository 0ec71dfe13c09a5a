"""Structured outputs through vLLM's real engine: vLLM's own scheduler vs ``DFlashRsScheduler``.

The engines load the tiny byte-level tokenizer of
``dflash_rs.bench.offline_models.write_tokenizer`` (``skip_tokenizer_init=False``), saved beside
each target's weights; prompts use its tokens.
Requests constrained by a JSON schema, a regex or a list of choices, mixed with plain ones,
with xgrammar and guidance (the backends vLLM's CPU build ships), without speculation and with
n-gram and EAGLE drafts (which the grammar cuts: ``validate_tokens``), in a pool small enough
to preempt. Greedy decoding of the random-weight targets inside the grammar's bitmask:

* ``test_same_outputs``: token ids and finish reasons per request equal vLLM's;
* ``test_same_schedule``: per step, the same tokens and drafts scheduled per request, the same
  preemptions, the same drafts proposed; for the groups that compile grammars when requests
  arrive (``sync_grammars``): with vLLM's asynchronous compilation (``qwen3-xgrammar``, whose
  requests wait for their grammars), which steps a request waits depends on timing, in two runs
  of vLLM's own scheduler as well;
* ``test_outputs_satisfy_grammar``: every constrained output decodes to text its constraint
  accepts (the JSON parses and matches the schema, the regex matches in full, the text is one
  of the choices), and ends with EOS (finish reason ``stop``): the grammar, not the model,
  shaped it.
"""

from __future__ import annotations

import os
import random
from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

from engine_parity import Group, request
from test_engine_parity import EAGLE, NGRAM, SMALL_POOL, Runs, schedule_difference, served

from dflash_rs.bench.offline_models import TOKENIZER_VOCAB, write_tokenizer
from support.structured import satisfies

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["ab", "cde", "fg"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
REGEX = "[a-d]{2,6}-[0-9]{1,3}"
CHOICES = ["alpha", "beta", "gamma delta"]
CONSTRAINTS: list[tuple[str, Any]] = [("json", SCHEMA), ("regex", REGEX), ("choice", CHOICES)]


def prompt_tokens(rng: random.Random, n: int) -> list[int]:
    """Byte tokens of the offline tokenizer (ids 3 to 258: no special token)."""
    return [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(n)]


def structured(seed: int, num: int = 12) -> dict[str, Any]:
    """``num`` requests cycling through the constraints, every fourth one plain; prompts from
    a few tokens to a chunked prefill, some sharing a 64-token prefix."""
    rng = random.Random(seed)
    shared = prompt_tokens(rng, 64)
    reqs = []
    for i in range(num):
        n = rng.choice([5, 30, 90, 300])
        prompt = (shared if i % 3 == 0 else []) + prompt_tokens(rng, n)
        if i % 4 == 3:
            reqs.append(request(prompt, max_tokens=24))
            continue
        kind, constraint = CONSTRAINTS[i % len(CONSTRAINTS)]
        reqs.append(request(prompt, max_tokens=64, structured_outputs={kind: constraint}))
    return {"name": "structured", "requests": reqs}


def structured_preempt(seed: int) -> dict[str, Any]:
    """Twelve JSON requests of 80-token prompts in a 24-block pool: eight fill it at three
    blocks each, their outputs (some 30 tokens) need a fourth, so some are preempted while their
    grammar is mid-way (a resumed request's grammar keeps its state)."""
    rng = random.Random(seed)
    reqs = [
        request(prompt_tokens(rng, 80), max_tokens=64, structured_outputs={"json": SCHEMA})
        for _ in range(12)
    ]
    return {"name": "structured-preempt", "requests": reqs, "expect": ["num_preemptions"]}


def engine(backend: str) -> dict[str, Any]:
    return {
        **SMALL_POOL,
        "skip_tokenizer_init": False,
        # No free whitespace in JSON: the grammar then always ends within max_tokens.
        "structured_outputs_config": {"backend": backend, "disable_any_whitespace": True},
    }


GROUPS = [
    Group(
        "qwen3-xgrammar",
        "qwen3",
        [structured(81), structured_preempt(82)],
        engine=engine("xgrammar"),
    ),
    Group(
        "qwen3-guidance", "qwen3", [structured(83)], engine=engine("guidance"), sync_grammars=True
    ),
    Group(
        "qwen3-xgrammar-ngram",
        "qwen3",
        [structured(84), structured_preempt(85)],
        spec=NGRAM,
        engine=engine("xgrammar"),
        sync_grammars=True,
    ),
    Group(
        "llama-guidance-eagle",
        "llama",
        [structured(86)],
        spec=EAGLE,
        engine=engine("guidance"),
        sync_grammars=True,
    ),
]
BY_NAME = {g.name: g for g in GROUPS}
CASES = [(g.name, c["name"]) for g in GROUPS for c in g.cases]
IDS = [f"{g}-{c}" for g, c in CASES]
SYNC_CASES = [(g, c) for g, c in CASES if BY_NAME[g].sync_grammars]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    r = Runs(str(tmp_path_factory.mktemp("engine-structured")), BY_NAME)
    for target in {g.target for g in GROUPS}:
        write_tokenizer(r.models[target])
    return r


def _served(runs: Runs, group: str, case: str) -> tuple[dict[str, Any], dict[str, Any]]:
    import test_engine_parity

    saved = test_engine_parity.BY_NAME
    test_engine_parity.BY_NAME = {**saved, **BY_NAME}  # served() looks the group up there
    try:
        return served(runs, group, case)
    finally:
        test_engine_parity.BY_NAME = saved


def _spec(group: str, case: str) -> dict[str, Any]:
    return next(c for c in BY_NAME[group].cases if c["name"] == case)


@pytest.mark.parametrize(("group", "case"), CASES, ids=IDS)
def test_same_outputs(runs: Runs, group: str, case: str) -> None:
    r, o = _served(runs, group, case)
    where = schedule_difference(r["schedule"], o["schedule"]) or "identical schedules"
    assert o["outputs"] == r["outputs"], f"first schedule difference: {where}"
    for counter in _spec(group, case).get("expect", ()):
        assert r["stats"][counter] > 0, f"vLLM's run had no {counter}: {r['stats']}"
        assert o["stats"][counter] > 0, f"the dflash-rs run had no {counter}: {o['stats']}"


@pytest.mark.parametrize(("group", "case"), SYNC_CASES, ids=[f"{g}-{c}" for g, c in SYNC_CASES])
def test_same_schedule(runs: Runs, group: str, case: str) -> None:
    r, o = _served(runs, group, case)
    difference = schedule_difference(r["schedule"], o["schedule"])
    assert not difference, difference


@pytest.mark.parametrize(("group", "case"), CASES, ids=IDS)
def test_outputs_satisfy_grammar(runs: Runs, group: str, case: str) -> None:
    from tokenizers import Tokenizer

    _, o = _served(runs, group, case)
    target = runs.models[BY_NAME[group].target]
    tokenizer = Tokenizer.from_file(os.path.join(target, "tokenizer.json"))
    checked = 0
    for i, q in enumerate(_spec(group, case)["requests"]):
        so = q["params"].get("structured_outputs")
        if so is None:
            continue
        ((kind, constraint),) = so.items()
        completion = o["outputs"][str(i)][0]
        ids = completion["token_ids"]
        assert completion["finish_reason"] == "stop" and ids[-1] == 2, completion
        text = tokenizer.decode(ids[:-1], skip_special_tokens=True)
        assert satisfies(kind, constraint, text), (kind, text)
        checked += 1
    assert checked >= 8
