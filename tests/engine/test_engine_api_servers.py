"""The drop-in behind ``vllm serve --api-server-count 2``: one EngineCore, two clients.

With several API server processes (vLLM's way to scale its HTTP front end), every request
reaches the EngineCore with its server's client index, and the scheduler must hand each
request's outputs back under that index: an output filed under the other server's index is
never read, and its HTTP request never completes. The single-server tests never exercise it
(every request has index 0). Each side starts the ``vllm serve`` command (``vllm_cli.py``) with
two API servers and DFlash K=3, ours with ``--scheduler-cls dflash_rs.vllm.DFlashRsScheduler``;
``--enable-log-requests`` makes each API server log the requests it added, so the tests see
that both served some. The clients:

1. thirty-two concurrent completions (half of them sharing a 96-token prefix);
2. two concurrent streamed requests whose clients hang up after a few chunks.

As in ``test_engine_openai.py``, batches depend on HTTP timing, so the sides are compared on
what does not: every completion's tokens and finish reason (float32), the engine's token
counters, and an engine emptied by the hang-ups.
"""

from __future__ import annotations

import random
import re
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

API_SERVERS = 2
SHARED_PREFIX = 96  # three 32-token blocks
#: vLLM's line for each request an API server process hands to the engine.
ADDED = re.compile(r"\(ApiServer_(\d+) pid=\d+\).*\bAdded request\b")


def workload() -> tuple[list[dict[str, Any]], list[list[int]]]:
    """Thirty-two completions (sixteen sharing a 96-token prefix) and two streamed prompts."""
    rng = random.Random(23)
    prefix = tokens(rng, SHARED_PREFIX)
    reqs = []
    for i in range(32):
        prompt = (prefix if i % 2 == 0 else []) + tokens(rng, rng.randrange(8, 72))
        reqs.append({"prompt": prompt, "max_tokens": rng.randrange(4, 40)})
    return reqs, [tokens(rng, 40), tokens(rng, 40)]


def phases(server: Server, deadline: float) -> dict[str, Any]:
    """Both phases against one two-server deployment."""
    reqs, streamed = workload()
    before = server.metrics()
    with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
        outputs = list(
            pool.map(lambda r: server.complete(r["prompt"], max_tokens=r["max_tokens"]), reqs)
        )
    after = server.wait_idle(deadline)
    with ThreadPoolExecutor(max_workers=len(streamed)) as pool:
        chunks = list(pool.map(lambda p: server.stream_then_disconnect(p, chunks=4), streamed))
    after_abort = server.wait_idle(deadline)
    return {
        "outputs": outputs,
        "completions": delta(before, after),
        "chunks": chunks,
        "after_abort": after_abort,
        "abort": delta(after, after_abort),
    }


def serve(models: dict[str, str], root: str, scheduler: str) -> dict[str, Any]:
    extra = ("--api-server-count", str(API_SERVERS), "--enable-log-requests")
    return run_phases(Server(models, root, scheduler, launcher="cli", extra=extra), phases)


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return run_sides(str(tmp_path_factory.mktemp("api-servers")), serve)


def test_both_api_servers_hand_requests_to_the_scheduler_asked_for(sides: Any) -> None:
    ref, ours = ok(sides["vllm"]), ok(sides["dflash-rs"])
    assert CUSTOM.search(ours["log"])
    assert not CUSTOM.search(ref["log"])
    for name in SIDES:
        servers = {int(m.group(1)) for m in ADDED.finditer(sides[name]["log"])}
        # Otherwise every request had one client index and nothing here was tested.
        assert servers == set(range(API_SERVERS)), (name, servers)


def test_every_completion_comes_back_to_its_own_server(sides: Any) -> None:
    ref, ours = ok(sides["vllm"]), ok(sides["dflash-rs"])
    assert ours["outputs"] == ref["outputs"]
    reqs, _ = workload()
    for r, o in zip(reqs, ours["outputs"]):
        assert o["finish_reason"] in ("length", "stop"), o
        # A stop token can also be the last one max_tokens allows: vLLM then reports "stop".
        assert len(o["tokens"]) <= r["max_tokens"], o
        assert o["finish_reason"] == "stop" or len(o["tokens"]) == r["max_tokens"], o
    # The API servers count what reached them: every request once, and its tokens.
    counters = ("vllm:request_success_total", "vllm:prompt_tokens_total")
    for name in SIDES:
        got = sides[name]["completions"]
        assert got["vllm:request_success_total"] == len(reqs), (name, got)
        assert got["vllm:prompt_tokens_total"] == sum(len(r["prompt"]) for r in reqs), name
        generated = sum(len(o["tokens"]) for o in sides[name]["outputs"])
        assert got["vllm:generation_tokens_total"] == generated, (name, got)
    assert {k: ours["completions"][k] for k in counters} == {
        k: ref["completions"][k] for k in counters
    }


def test_clients_that_hang_up_leave_no_request_and_no_block(sides: Any) -> None:
    for name in SIDES:
        run = ok(sides[name])
        assert run["chunks"] == [4, 4], name
        m, d = run["after_abort"], run["abort"]
        assert m["vllm:num_requests_running"] == 0, (name, m)
        assert m["vllm:kv_cache_usage_perc"] == 0.0, (name, m)
        assert d["vllm:request_success_total"] == 0, (name, d)
        # Both were stopped long before their max_tokens (one verification, K + 1 tokens at
        # most, per K + 1 tokens).
        assert d["vllm:spec_decode_num_drafts_total"] < 2 * STREAMED_MAX_TOKENS / (K + 1), (
            name,
            d,
        )
