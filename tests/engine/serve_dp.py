"""A data-parallel vLLM engine (``data_parallel_size=2``) serving waves of requests, run as a
subprocess by ``test_engine_dp.py``.

    python tests/engine/serve_dp.py SPEC_JSON

``SPEC_JSON`` holds ``engine`` (``AsyncEngineArgs`` keyword arguments, model path included),
``scheduler`` (``"vllm"`` or ``"dflash-rs"``), ``waves`` (lists of requests ``{"id", "prompt",
"params"}``, each wave sent at once after the previous one has finished, so the engines go idle
and start a new DP wave in between) and ``out`` (where the JSON result goes).

This is vLLM's internal load balancing: ``AsyncLLM`` starts one ``DPEngineCoreProc`` per rank
and a ``DPCoordinator`` that collects every rank's ``SchedulerStats`` (running and waiting
counts) and wave state; the front-end routes each request to the rank with the fewest
requests by those counts. The result holds the token ids and finish reason per request, and
vLLM's counters per engine rank.
"""

from __future__ import annotations

import asyncio
from typing import Any

from serve import run_and_exit

SCHEDULERS = {"vllm": None, "dflash-rs": "dflash_rs.vllm.DFlashRsScheduler"}
COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
)


def per_engine_counters() -> dict[str, dict[str, float]]:
    """vLLM's counters by engine rank (the ``engine`` label), summed over other labels."""
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    out: dict[str, dict[str, float]] = {}
    for m in get_metrics_snapshot():
        if isinstance(m, Counter) and m.name in COUNTERS:
            engine = m.labels.get("engine", "?")
            by_name = out.setdefault(engine, dict.fromkeys(COUNTERS, 0.0))
            by_name[m.name] += m.value
    return out


async def serve(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kwargs = dict(spec["engine"])
    cls = SCHEDULERS[spec["scheduler"]]
    if cls is not None:
        kwargs["scheduler_cls"] = cls
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def one(r: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(**{"temperature": 0.0, "detokenize": False, **r["params"]})
        final = None
        async for out in llm.generate({"prompt_token_ids": r["prompt"]}, params, r["id"]):
            final = out
        assert final is not None
        c = final.outputs[0]
        return {"token_ids": list(c.token_ids), "finish_reason": c.finish_reason}

    outputs: dict[str, Any] = {}
    try:
        for wave in spec["waves"]:
            done = await asyncio.gather(*(one(r) for r in wave))
            outputs.update({r["id"]: d for r, d in zip(wave, done)})
        # The last stats reach the front-end with the engines' next output batch: wait for them.
        await asyncio.sleep(1.0)
        return {"outputs": outputs, "engines": per_engine_counters()}
    finally:
        llm.shutdown()


def main() -> None:
    run_and_exit(lambda spec: asyncio.run(serve(spec)))


if __name__ == "__main__":
    main()
