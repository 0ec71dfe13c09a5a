"""vLLM's OpenAI-compatible HTTP server for the real-engine tests: its command line, one running
server (its process group, log and URL), the HTTP calls the tests make, and a test's phases run
against a server of each scheduler (``run_sides``, ``run_phases``).

Two launchers start the same server:

- ``"module"``: ``python -m vllm.entrypoints.openai.api_server``, one API server process;
- ``"cli"``: the ``vllm serve`` command (``vllm_cli.py``), which can run several API server
  processes (``--api-server-count``), each its own client of the one EngineCore.

Either way the EngineCore runs in its own process, driven by vLLM's busy loop over ZMQ, as in
production.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from engine_parity import SIDES, write_models

TIMEOUT = float(os.environ.get("DFLASH_RS_ENGINE_TIMEOUT", "600"))
JOBS = int(os.environ.get("DFLASH_RS_ENGINE_JOBS", "2"))
VLLM_CLI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_cli.py")
#: vLLM's own line, printed by the engine process when it builds a custom scheduler class.
CUSTOM = re.compile(r"EngineCore.*Using custom scheduler class dflash_rs\.vllm\.DFlashRsScheduler")
K = 3  # DFlash's draft tokens a step
#: A streamed request's length: it would run for seconds had its abort been lost.
STREAMED_MAX_TOKENS = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_args(
    models: dict[str, str],
    port: int,
    scheduler: str,
    launcher: str = "module",
    extra: tuple[str, ...] = (),
) -> list[str]:
    """The server's command line: the tiny Qwen3 with DFlash K=3, float32 (batches differ
    between the sides, so outputs must not depend on them), a 64 MiB KV cache."""
    spec = {
        "method": "dflash",
        "model": models["dflash"],
        "num_speculative_tokens": K,
        "draft_load_config": {"load_format": "dummy"},
    }
    if launcher == "module":
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    elif launcher == "cli":
        command = [sys.executable, VLLM_CLI, "serve"]
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    args = [
        *command,
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
        *extra,
    ]
    if scheduler == "dflash-rs":
        args += ["--scheduler-cls", "dflash_rs.vllm.DFlashRsScheduler"]
    return args


class Server:
    """One server (its API server processes and EngineCore, one process group), its log and
    its base URL."""

    def __init__(
        self,
        models: dict[str, str],
        root: str,
        scheduler: str,
        launcher: str = "module",
        extra: tuple[str, ...] = (),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(root, f"{launcher}-{scheduler}.log")
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
            server_args(models, self.port, scheduler, launcher, extra),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stop() ends every process of it
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
        try:  # whatever of the group outlived the server (API servers, the EngineCore)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
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


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


#: A test's phases against one ready server, given its deadline; returns what the tests compare.
Phases = Callable[["Server", float], dict[str, Any]]


def run_phases(server: Server, phases: Phases) -> dict[str, Any]:
    """Waits for ``server``, runs ``phases`` and stops it; what they return plus the server's
    log, or the error and the log (reported by the tests)."""
    try:
        deadline = time.monotonic() + TIMEOUT
        server.wait_ready(deadline)
        return {**phases(server, deadline), "log": server.log()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}", "log": server.log()}
    finally:
        server.stop()


def run_sides(
    root: str, serve: Callable[[dict[str, str], str, str], dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Writes the tiny models under ``root``, then runs ``serve(models, root, scheduler)`` for
    both schedulers, ``JOBS`` at a time."""
    from dflash_rs.bench.offline_models import write_tokenizer

    models = write_models(root)
    write_tokenizer(models["qwen3"])
    with ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        futures = {s: pool.submit(serve, models, root, s) for s in SIDES}
        return {s: f.result() for s, f in futures.items()}


def ok(run: dict[str, Any]) -> dict[str, Any]:
    """A side's run, asserted free of errors (the message carries the server's log's end)."""
    assert "error" not in run, f"{run['error']}\n{run['log'][-6000:]}"
    return run
