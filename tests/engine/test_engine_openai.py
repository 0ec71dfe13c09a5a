"""The drop-in behind vLLM's OpenAI-compatible HTTP server, as users deploy it.

Each side starts ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve``'s server;
``vllm-cpu`` 0.32's ``vllm`` console script cannot start: it asks ``importlib.metadata`` for
a distribution named ``vllm``) with ``--scheduler-cls dflash_rs.vllm.DFlashRsScheduler`` or
without it, and DFlash K=3. The EngineCore then runs in its own process, driven by vLLM's busy
loop over ZMQ, as in production. Clients send token-id completions over HTTP:

1. sixteen concurrent requests (half of them sharing a 96-token prefix);
2. a streamed request whose client disconnects after a few chunks: the server aborts it, and
   the engine must then hold no running request and no KV-cache block;
3. the shared-prefix requests again, one at a time: prefix-cache hits, counted by vLLM.

Which requests share a step depends on HTTP timing, so the sides are compared on what does
not: every completion's tokens and finish reason (float32, as batches differ), the prefix hits
of the sequential phase, and an engine emptied by the disconnect.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

from engine_parity import SIDES, tokens
from http_server import CUSTOM, STREAMED_MAX_TOKENS, K, Server, delta, ok, run_phases, run_sides

pytestmark = pytest.mark.slow

SHARED_PREFIX = 96  # three 32-token blocks


def workload() -> tuple[list[dict[str, Any]], list[int]]:
    """Sixteen completions (eight sharing a 96-token prefix) and the streamed prompt."""
    rng = random.Random(11)
    prefix = tokens(rng, SHARED_PREFIX)
    reqs = []
    for i in range(16):
        shared = i % 2 == 0
        prompt = (prefix if shared else []) + tokens(rng, rng.randrange(8, 72))
        reqs.append({"shared": shared, "prompt": prompt, "max_tokens": rng.randrange(4, 40)})
    return reqs, tokens(rng, 40)


def phases(server: Server, deadline: float) -> dict[str, Any]:
    """The three phases against one server."""
    reqs, streamed = workload()
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        outputs = list(
            pool.map(lambda r: server.complete(r["prompt"], max_tokens=r["max_tokens"]), reqs)
        )
    before_abort = server.wait_idle(deadline)
    chunks = server.stream_then_disconnect(streamed, chunks=4)
    after_abort = server.wait_idle(deadline)
    before = server.metrics()
    again = [server.complete(r["prompt"], max_tokens=r["max_tokens"]) for r in reqs if r["shared"]]
    after = server.wait_idle(deadline)
    return {
        "outputs": outputs,
        "again": again,
        "chunks": chunks,
        "after_abort": after_abort,
        "abort": delta(before_abort, after_abort),
        "sequential": delta(before, after),
    }


def serve(models: dict[str, str], root: str, scheduler: str) -> dict[str, Any]:
    return run_phases(Server(models, root, scheduler), phases)


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_sides(str(tmp_path_factory.mktemp("openai")), serve)


def test_the_engine_process_runs_the_scheduler_asked_for(sides: Any) -> None:
    ref, ours = ok(sides["vllm"]), ok(sides["dflash-rs"])
    assert CUSTOM.search(ours["log"])
    assert not CUSTOM.search(ref["log"])


def test_same_completions_over_http(sides: Any) -> None:
    ref, ours = ok(sides["vllm"]), ok(sides["dflash-rs"])
    assert ours["outputs"] == ref["outputs"]
    assert ours["again"] == ref["again"]
    # Greedy decoding is deterministic here: the repeated prompts complete as before.
    shared = [o for i, o in enumerate(ours["outputs"]) if i % 2 == 0]
    assert ours["again"] == shared
    reqs, _ = workload()
    for r, o in zip(reqs, ours["outputs"]):
        assert o["finish_reason"] in ("length", "stop"), o
        assert (len(o["tokens"]) == r["max_tokens"]) == (o["finish_reason"] == "length"), o


def test_a_client_that_hangs_up_leaves_no_request_and_no_block(sides: Any) -> None:
    for name in SIDES:
        run = ok(sides[name])
        assert run["chunks"] == 4, name
        m, d = run["after_abort"], run["abort"]
        assert m["vllm:num_requests_running"] == 0, (name, m)
        assert m["vllm:kv_cache_usage_perc"] == 0.0, (name, m)
        # The engine stopped it long before its max_tokens: reaching them would have taken at
        # least one verification (K + 1 tokens at most) per K + 1 tokens.
        assert d["vllm:request_success_total"] == 0, (name, d)
        assert d["vllm:spec_decode_num_drafts_total"] < STREAMED_MAX_TOKENS / (K + 1), (name, d)


def test_sequential_repeats_hit_the_prefix_cache_as_vllms_scheduler_does(sides: Any) -> None:
    ref, ours = ok(sides["vllm"]), ok(sides["dflash-rs"])
    counters = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    got = {k: ours["sequential"][k] for k in counters}
    assert got == {k: ref["sequential"][k] for k in counters}
    # Each repeated prompt finds its whole prompt cached, less the last hit block, which vLLM
    # 0.32 recomputes for DFlash's drafter KV: at least two of its shared prefix's three blocks.
    assert got["vllm:prefix_cache_hits_total"] >= 8 * (SHARED_PREFIX - 32)
    assert ours["sequential"]["vllm:spec_decode_num_drafts_total"] > 0
