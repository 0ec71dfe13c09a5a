"""Data parallelism through vLLM's real engine: ``data_parallel_size=2`` with vLLM's internal
load balancing (``AsyncLLM``, one ``DPEngineCoreProc`` per rank, the ``DPCoordinator``),
vLLM's own scheduler vs ``DFlashRsScheduler`` in every rank.

The coordinator and the front-end's load balancer read what each rank's scheduler reports:
``SchedulerStats`` (running and waiting counts, KV-cache usage), published with the engine's
step counter and wave, and ``has_unfinished_requests`` for the ranks' idle/wave handshake. The
scheduler-level parity traces compare those values with vLLM's after every call
(``tests/vllm/parity.py``, ``_compare_state``); here two waves of requests (the engines go idle
in between and start a new wave) are served end to end. Which rank gets a request depends on
the timing of the published counts, so the test compares what does not: every request's
tokens and finish reason, the totals of vLLM's counters, and that both ranks served requests.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

pytest.importorskip(
    "vllm.version",
    reason="vLLM is not installed here; run these tests with scripts/vllm_cpu_env.sh",
)

from engine_parity import BASE_ENGINE, SIDES, tokens, write_models

pytestmark = pytest.mark.slow

SERVE_DP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve_dp.py")
TIMEOUT = float(os.environ.get("DFLASH_RS_ENGINE_TIMEOUT", "600"))
JOBS = int(os.environ.get("DFLASH_RS_ENGINE_JOBS", "2"))
#: vLLM's own line, printed by each engine process that builds a custom scheduler class.
CUSTOM = re.compile(
    r"EngineCore_DP(\d).*Using custom scheduler class dflash_rs\.vllm\.DFlashRsScheduler"
)


def waves() -> list[list[dict[str, Any]]]:
    """Two waves of twelve requests sharing a 64-token prefix (prefix hits on each rank)."""
    rng = random.Random(7)
    prefix = tokens(rng, 64)
    out = []
    for w in range(2):
        out.append(
            [
                {
                    "id": f"w{w}-{i}",
                    "prompt": prefix + tokens(rng, rng.randrange(8, 48)),
                    "params": {"max_tokens": rng.randrange(4, 24)},
                }
                for i in range(12)
            ]
        )
    return out


def run_side(
    models: dict[str, str], root: str, scheduler: str, interval: int
) -> tuple[dict[str, Any], str]:
    engine = {k: v for k, v in BASE_ENGINE.items() if k != "distributed_executor_backend"}
    # float32: which rank serves a request, and so the batches it shares, depends on timing;
    # in bf16 a different batch can flip a near-tied greedy token, in float32 it does not.
    engine |= {"model": models["qwen3"], "data_parallel_size": 2, "dtype": "float32"}
    if interval > 1:
        # The DP engine core then throttles prefills on every step the interval skips
        # (schedule(throttle_prefills=True)).
        engine["prefill_schedule_interval"] = interval
    out = os.path.join(root, f"dp-{scheduler}-{interval}.json")
    log = os.path.join(root, f"dp-{scheduler}-{interval}.log")
    spec = {"engine": engine, "scheduler": scheduler, "waves": waves(), "out": out}
    env = {
        **os.environ,
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONHASHSEED": "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # DP runs one engine process per rank
    with open(log, "w") as f:
        try:
            subprocess.run(
                [sys.executable, SERVE_DP, json.dumps(spec)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pass
    with open(log) as f:
        text = f.read()
    if not os.path.exists(out):
        return {"error": f"serve_dp.py left no result:\n{text[-4000:]}"}, text
    with open(out) as f:
        return json.load(f), text


@pytest.fixture(scope="module", params=[1, 2], ids=lambda i: f"prefill-interval-{i}")
def sides(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, Any], str]]:
    """Both schedulers' runs, with the default prefill interval and with the DP engine core's
    prefill throttle every other step."""
    root = str(tmp_path_factory.mktemp("dp"))
    models = write_models(root)
    with ThreadPoolExecutor(max_workers=max(1, JOBS)) as pool:
        futures = {s: pool.submit(run_side, models, root, s, request.param) for s in SIDES}
        return {s: f.result() for s, f in futures.items()}


def test_every_rank_runs_the_scheduler_asked_for(sides: Any) -> None:
    (ref, ref_log), (ours, ours_log) = sides["vllm"], sides["dflash-rs"]
    assert "error" not in ref, ref.get("traceback", ref.get("error"))
    assert "error" not in ours, ours.get("traceback", ours.get("error"))
    assert {m.group(1) for m in CUSTOM.finditer(ours_log)} == {"0", "1"}
    assert not CUSTOM.search(ref_log)


def test_same_outputs_and_counters_with_both_ranks_serving(sides: Any) -> None:
    (ref, _), (ours, _) = sides["vllm"], sides["dflash-rs"]
    assert "error" not in ref and "error" not in ours
    assert ours["outputs"] == ref["outputs"]
    assert len(ref["outputs"]) == 24
    for name, run in (("vllm", ref), ("dflash-rs", ours)):
        engines = run["engines"]
        assert set(engines) == {"0", "1"}, (name, engines)
        for rank, counters in engines.items():
            assert counters["vllm:request_success"] > 0, f"{name}: rank {rank} served nothing"
    totals = {
        name: {
            k: sum(c[k] for c in run["engines"].values())
            for k in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success")
        }
        for name, run in (("vllm", ref), ("dflash-rs", ours))
    }
    assert totals["dflash-rs"] == totals["vllm"]
    assert totals["vllm"]["vllm:request_success"] == 24
