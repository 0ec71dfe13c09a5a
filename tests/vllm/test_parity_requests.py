"""Parity of per-request features the scheduler takes part in: LoRA adapters under vLLM's
``max_loras`` (a waiting request whose adapter would be one too many in the step is passed over
and keeps its place; adapters key the prefix cache), prompt logprobs (no prefix-cache hit is
read for such a request, its blocks are still cached, and the runner's prompt logprobs reach
its ``EngineCoreOutput``) and prompts given as embeddings (no token ids; each block's
embeddings key its prefix-cache entry). Same lockstep driver as ``test_parity.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.core.sched.interface",
    reason="vLLM 0.33 is not installed here; run these tests with scripts/vllm_env.sh",
)

from parity import Lockstep, TraceParams

from dflash_rs.vllm._compat import installed

EAGLE = {"speculative": {"disable_eagle_block_drop": True}}


def _params(method: str, seed: int, in_flight: int = 0, **kw: Any) -> TraceParams:
    extra: dict[str, Any] = {"extra": EAGLE} if method == "eagle" else {}
    if in_flight:
        extra.update(async_scheduling=True, batch_queue_size=in_flight, rewrite_drafts_prob=0.2)
    return TraceParams(seed=seed, method=method, k=3, **extra, **kw)


def _skip_async_ngram(method: str, in_flight: int) -> None:
    if method == "ngram" and in_flight and installed().name == "0.32":
        pytest.skip("vLLM 0.32 refuses async scheduling with the CPU n-gram drafter")


_LORA = [
    (method, max_loras, adapters, seed, in_flight, policy)
    for method, max_loras, adapters, seed, in_flight, policy in [
        ("none", 1, 3, 0, 0, "fcfs"),
        ("none", 2, 4, 1, 0, "fcfs"),
        ("none", 1, 2, 2, 0, "priority"),
        ("dflash", 1, 3, 0, 0, "fcfs"),
        ("dflash", 2, 3, 1, 0, "fcfs"),
        ("dflash", 2, 4, 2, 0, "priority"),
        ("ngram", 2, 3, 0, 0, "fcfs"),
        ("eagle", 1, 2, 0, 0, "fcfs"),
        ("none", 1, 3, 0, 2, "fcfs"),
        ("dflash", 2, 4, 0, 2, "fcfs"),
        ("dflash", 1, 2, 1, 3, "fcfs"),
        ("dflash", 2, 3, 0, 2, "priority"),
    ]
]


@pytest.mark.parametrize(
    "method,max_loras,adapters,seed,in_flight,policy",
    _LORA,
    ids=[f"{m}-max{x}-of{a}-{p}-async{i}-seed{s}" for m, x, a, s, i, p in _LORA],
)
def test_lora_parity(
    offline: Any, method: str, max_loras: int, adapters: int, seed: int, in_flight: int, policy: str
) -> None:
    _skip_async_ngram(method, in_flight)
    p = _params(method, seed, in_flight, policy=policy, max_loras=max_loras, num_adapters=adapters)
    res = Lockstep(offline, p).run()
    assert res.finished > 0
    assert res.max_step_adapters <= max_loras


def test_lora_traces_hit_the_limit(offline: Any) -> None:
    """The LoRA traces do pass waiting requests over at max_loras, and still preempt and hit
    the prefix cache (so their parity is not vacuous)."""
    totals = {"lora_limited_steps": 0, "preemptions": 0, "prefix_hit_admissions": 0}
    for max_loras, seed in ((1, 0), (2, 1)):
        res = Lockstep(offline, _params("dflash", seed, max_loras=max_loras, num_adapters=3)).run()
        assert res.max_step_adapters == max_loras
        for key in totals:
            totals[key] += getattr(res, key)
    assert all(v > 0 for v in totals.values()), totals


_PROMPT_LOGPROBS = [
    ("none", 0, 0),
    ("none", 1, 0),
    ("dflash", 0, 0),
    ("dflash", 1, 0),
    ("ngram", 0, 0),
    ("eagle", 0, 0),
    ("none", 0, 2),
    ("dflash", 0, 2),
    ("dflash", 1, 3),
]


@pytest.mark.parametrize(
    "method,seed,in_flight",
    _PROMPT_LOGPROBS,
    ids=[f"{m}-async{i}-seed{s}" for m, s, i in _PROMPT_LOGPROBS],
)
def test_prompt_logprobs_parity(offline: Any, method: str, seed: int, in_flight: int) -> None:
    _skip_async_ngram(method, in_flight)
    res = Lockstep(offline, _params(method, seed, in_flight, prompt_logprobs_prob=0.4)).run()
    assert res.finished > 0


def test_prompt_logprob_traces_share_prefixes(offline: Any) -> None:
    """Prompt-logprob requests with the shared prefix are admitted (reading no hit; parity
    checks num_computed_tokens), other requests still hit the prefix cache, and prompt logprobs
    reach the outputs."""
    totals = {"prompt_logprob_admissions": 0, "prefix_hit_admissions": 0}
    for seed in (0, 1):
        res = Lockstep(offline, _params("dflash", seed, prompt_logprobs_prob=0.4)).run()
        assert res.prompt_logprob_outputs > 0
        for key in totals:
            totals[key] += getattr(res, key)
    assert all(v > 0 for v in totals.values()), totals


def test_lora_and_prompt_logprobs_together(offline: Any) -> None:
    p = _params("dflash", 3, max_loras=2, num_adapters=3, prompt_logprobs_prob=0.3)
    res = Lockstep(offline, p).run()
    assert res.finished > 0 and res.prompt_logprob_outputs > 0


_PROMPT_EMBEDS = [
    ("none", 0, 0),
    ("none", 1, 0),
    ("dflash", 0, 0),
    ("eagle", 0, 0),
    ("ngram", 1, 0),
    ("none", 0, 2),
    ("dflash", 1, 2),
    ("dflash", 0, 3),
]


@pytest.mark.parametrize(
    "method,seed,in_flight",
    _PROMPT_EMBEDS,
    ids=[f"{m}-async{i}-seed{s}" for m, s, i in _PROMPT_EMBEDS],
)
def test_prompt_embeds_parity(offline: Any, method: str, seed: int, in_flight: int) -> None:
    _skip_async_ngram(method, in_flight)
    res = Lockstep(offline, _params(method, seed, in_flight, prompt_embeds_prob=0.5)).run()
    assert res.finished > 0


def test_prompt_embeds_traces_hit_shared_embeddings(offline: Any) -> None:
    """Prompt-embedding requests are admitted, some with a prefix-cache hit on the shared
    prefix's embeddings."""
    res = Lockstep(offline, _params("none", 2, prompt_embeds_prob=0.5)).run()
    assert res.prompt_embeds_admissions > 0 and res.prompt_embeds_hits > 0, res


def test_every_feature_together(offline: Any) -> None:
    p = _params(
        "dflash",
        5,
        2,
        max_loras=2,
        num_adapters=3,
        prompt_logprobs_prob=0.3,
        prompt_embeds_prob=0.3,
    )
    res = Lockstep(offline, p).run()
    assert res.finished > 0 and res.prompt_embeds_admissions > 0
