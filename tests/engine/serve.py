"""One real vLLM engine serving a list of cases, run as a subprocess by the engine tests.

    python tests/engine/serve.py SPEC_JSON

``SPEC_JSON`` (a JSON string) holds ``engine`` (``vllm.LLM`` keyword arguments, model paths
included), ``scheduler`` (``"vllm"`` for vLLM's own, ``"dflash-rs"`` for
``dflash_rs.vllm.DFlashRsScheduler``), ``cases`` and ``out`` (where the JSON result goes).

A case is ``{"name", "requests": [{"prompt", "params", ...}], "engine"?, "abort"?}``:
``prompt`` is a token-id list, ``params`` ``SamplingParams`` keyword arguments (greedy and
``detokenize=False`` unless given; ``structured_outputs`` as a dict of
``StructuredOutputsParams`` arguments), ``priority`` optional, ``lora`` the index of one of
the spec's ``loras`` adapters (``{"lora-<target>-<i>": path}``), ``embeds`` a list of
``[seed, length]`` segments: the prompt is then those seeded random embeddings (``prompt`` is
ignored). Without ``engine`` the requests go to ``LLM.generate``, one call per ``wave``
(default 0, in order). With ``engine`` the worker drives ``LLM.llm_engine`` (the
``LLMEngine`` that ``LLM`` builds with ``from_engine_args``) itself:
``add_request`` before step ``arrive`` (default 0), ``step()`` until all have finished, and
``abort_request`` for request ``i`` right after ``abort[i]`` steps. ``reset_after`` calls
``LLM.reset_prefix_cache()`` after the case.

With ``sync_grammars`` each structured-output grammar is compiled when its request arrives
(``compile_grammars_at_arrival``), not asynchronously.

With ``kv_events`` the engine publishes KV-cache events through vLLM's ZMQ publisher (on ipc
endpoints next to ``out``, with a replay socket); ``EventSubscriber`` receives them as a KV-aware
router does (a SUB socket, ``msgspec`` decoding into ``KVEventBatch``) and, after the last
case, asks the replay socket for every batch from sequence 0. The result then holds
``kv_events``: ``live`` and ``replayed``, each a list of ``[seq, data-parallel rank, events]``
(events as plain data, without the batch timestamps).

The result holds, per case, per request index: the token ids and finish reason of each
completion (``"aborted"`` with the tokens seen so far for aborted requests), the deltas of
vLLM's metric counters over the case (``stats``) and a trace of the scheduler (``schedule``,
see ``record_schedule``); or ``error`` if the case raised. Engine construction errors are
reported as a top-level ``error``. The process exits with ``os._exit`` (an in-process engine's
interpreter teardown is slow and noisy).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

SCHEDULERS = {"vllm": None, "dflash-rs": "dflash_rs.vllm.DFlashRsScheduler"}
#: vLLM counters reported per case (summed over their label sets).
COUNTERS = (
    "vllm:num_preemptions",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def counters(llm: Any) -> dict[str, float]:
    """Current values of ``COUNTERS``."""
    from vllm.v1.metrics.reader import Counter

    out = dict.fromkeys(COUNTERS, 0.0)
    for m in llm.get_metrics():
        if isinstance(m, Counter) and m.name in out:
            out[m.name] += m.value
    return out


def record_schedule(scheduler: Any, trace: list[Any]) -> None:
    """Appends one entry per ``schedule()`` call (sorted ``[request id, scheduled tokens,
    scheduled drafts]`` rows, sorted preempted ids) and per ``update_draft_token_ids`` call
    (``[request id, drafts]`` rows, what the model runner proposed)."""
    schedule, update_drafts = scheduler.schedule, scheduler.update_draft_token_ids

    def traced_schedule(*args: Any, **kwargs: Any) -> Any:
        out = schedule(*args, **kwargs)
        spec = out.scheduled_spec_decode_tokens
        rows = sorted([r, n, len(spec.get(r, ()))] for r, n in out.num_scheduled_tokens.items())
        trace.append({"scheduled": rows, "preempted": sorted(out.preempted_req_ids or ())})
        return out

    def traced_update_drafts(draft_token_ids: Any, *args: Any, **kwargs: Any) -> Any:
        ids, drafts = draft_token_ids.req_ids, draft_token_ids.draft_token_ids
        trace.append({"drafts": sorted([r, list(d)] for r, d in zip(ids, drafts))})
        return update_drafts(draft_token_ids, *args, **kwargs)

    scheduler.schedule = traced_schedule
    scheduler.update_draft_token_ids = traced_update_drafts


class EventSubscriber:
    """A KV-aware router's view of the engine's events: a SUB socket on the publisher's
    endpoint, read by a thread, and the replay socket (a DEALER asking from a sequence)."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        import threading

        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.zmq, self.msgspec = zmq, msgspec
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay_endpoint, self.topic = replay_endpoint, topic
        self.live: list[Any] = []
        self.last_message = time.monotonic()
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()
        time.sleep(0.5)  # PUB/SUB: let the subscription reach the publisher

    def _entry(self, seq: bytes, payload: bytes) -> list[Any]:
        batch = self.decoder.decode(payload)
        events = self.msgspec.to_builtins(batch.events)
        return [int.from_bytes(seq, "big"), batch.data_parallel_rank, events]

    def _read(self) -> None:
        while self.running:
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic.encode()
                self.live.append(self._entry(seq, payload))
                self.last_message = time.monotonic()

    def drain(self, quiet_s: float = 1.0) -> None:
        """Waits until no batch arrived for ``quiet_s``."""
        while time.monotonic() - self.last_message < quiet_s:
            time.sleep(0.1)

    def replay(self, start: int = 0) -> list[Any]:
        """Every batch from sequence ``start`` on, from the replay socket."""
        zmq = self.zmq
        sock = self.ctx.socket(zmq.DEALER)
        sock.connect(self.replay_endpoint)
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while sock.poll(5000):
            _, topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                break
            assert topic == self.topic.encode()
            out.append(self._entry(seq, payload))
        sock.close(linger=0)
        return out

    def close(self) -> None:
        self.running = False
        self.thread.join()
        self.sub.close(linger=0)


def sampling_params(params: dict[str, Any]) -> Any:
    """``SamplingParams`` of a case request; ``structured_outputs`` holds the keyword arguments
    of vLLM's ``StructuredOutputsParams`` (``json``, ``regex``, ``choice``, ...)."""
    from vllm import SamplingParams

    params = dict(params)
    if "structured_outputs" in params:
        from vllm.sampling_params import StructuredOutputsParams

        params["structured_outputs"] = StructuredOutputsParams(**params["structured_outputs"])
    return SamplingParams(**({"temperature": 0.0, "detokenize": False} | params))


def prompt_logprobs(out: Any) -> Any:
    """A request's prompt logprobs as JSON: per position, sorted ``[token, logprob (4
    decimals), rank]`` rows (None for the first position)."""
    if out.prompt_logprobs is None:
        return None
    return [
        None if pos is None else sorted([t, round(lp.logprob, 4), lp.rank] for t, lp in pos.items())
        for pos in out.prompt_logprobs
    ]


def completions(out: Any) -> list[dict[str, Any]]:
    res = [{"token_ids": list(c.token_ids), "finish_reason": c.finish_reason} for c in out.outputs]
    plp = prompt_logprobs(out)
    if plp is not None:
        res[0]["prompt_logprobs"] = plp
    return res


class Inputs:
    """A case request's prompt (token ids or seeded embeddings) and LoRA request."""

    def __init__(self, llm: Any, loras: dict[str, str]) -> None:
        self.hidden = llm.llm_engine.model_config.get_hidden_size()
        self.loras = loras

    def prompt(self, r: dict[str, Any]) -> dict[str, Any]:
        if "embeds" not in r:
            return {"prompt_token_ids": r["prompt"]}
        import torch

        parts = []
        for seed, length in r["embeds"]:
            gen = torch.Generator().manual_seed(seed)
            parts.append(torch.randn(length, self.hidden, generator=gen))
        return {"prompt_embeds": torch.cat(parts)}

    def lora(self, r: dict[str, Any]) -> Any:
        if r.get("lora") is None:
            return None
        from vllm.lora.request import LoRARequest

        i = r["lora"]
        path = next(p for name, p in self.loras.items() if name.endswith(f"-{i}"))
        return LoRARequest(f"adapter{i}", i, path)


def run_generate(llm: Any, requests: list[dict[str, Any]], inputs: Inputs) -> dict[str, Any]:
    results: dict[str, Any] = {}
    waves = sorted({r.get("wave", 0) for r in requests})
    for wave in waves:
        idx = [i for i, r in enumerate(requests) if r.get("wave", 0) == wave]
        prompts = [inputs.prompt(requests[i]) for i in idx]
        params = [sampling_params(requests[i]["params"]) for i in idx]
        priority = [requests[i].get("priority", 0) for i in idx]
        loras = [inputs.lora(requests[i]) for i in idx]
        lora = loras if any(x is not None for x in loras) else None
        outs = llm.generate(prompts, params, use_tqdm=False, priority=priority, lora_request=lora)
        for i, out in zip(idx, outs):
            results[str(i)] = completions(out)
    return results


def run_steps(llm: Any, case: dict[str, Any], inputs: Inputs) -> dict[str, Any]:
    """Drives ``LLMEngine`` step by step: request ``i`` is added before step ``arrive`` (default
    0) and aborted after ``abort[i]`` steps (a no-op if it has finished by then)."""
    engine = llm.llm_engine
    requests, abort = case["requests"], case.get("abort", {})
    ids = [f"{case['name']}-{i}" for i in range(len(requests))]
    latest: dict[str, Any] = {}
    aborted: set[str] = set()
    steps, last_arrival = 0, max(r.get("arrive", 0) for r in requests)
    while steps <= last_arrival or engine.has_unfinished_requests():
        for rid, r in zip(ids, requests):
            if r.get("arrive", 0) == steps:
                params = sampling_params(r["params"])
                engine.add_request(
                    rid,
                    inputs.prompt(r),
                    params,
                    priority=r.get("priority", 0),
                    lora_request=inputs.lora(r),
                )
        for out in engine.step():
            latest[out.request_id] = out
        steps += 1
        due = [ids[int(i)] for i, s in abort.items() if s == steps]
        if due:
            engine.abort_request(due)
            aborted.update(rid for rid in due if not (rid in latest and latest[rid].finished))
        if steps > 10_000:
            raise RuntimeError("the engine did not finish in 10000 steps")
    results: dict[str, Any] = {}
    for i, rid in enumerate(ids):
        out = latest.get(rid)
        if rid in aborted:
            toks = list(out.outputs[0].token_ids) if out is not None else []
            results[str(i)] = [{"token_ids": toks, "finish_reason": "aborted"}]
        else:
            results[str(i)] = completions(out)
    return results


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Request ids as given (vLLM appends random characters otherwise): the same in both runs.
    os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM

    doc: dict[str, Any] = {"vllm_version": vllm.__version__, "cases": {}}
    kwargs = dict(spec["engine"])
    cls = SCHEDULERS[spec["scheduler"]]
    if cls is not None:
        kwargs["scheduler_cls"] = cls
    endpoints = None
    if spec.get("kv_events"):
        from vllm.config import KVEventsConfig

        endpoints = (f"ipc://{spec['out']}.pub", f"ipc://{spec['out']}.replay", "kv")
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=endpoints[0],
            replay_endpoint=endpoints[1],
            topic=endpoints[2],
        )
    if spec.get("sync_grammars"):
        compile_grammars_at_arrival()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        return doc | {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    core = llm.llm_engine.engine_core.engine_core
    sched = type(core.scheduler)
    doc["scheduler_class"] = f"{sched.__module__}.{sched.__qualname__}"
    doc["startup_s"] = time.perf_counter() - t0
    trace: list[Any] = []
    record_schedule(core.scheduler, trace)
    subscriber = EventSubscriber(*endpoints) if endpoints else None
    inputs = Inputs(llm, spec.get("loras", {}))
    for case in spec["cases"]:
        t = time.perf_counter()
        before = counters(llm)
        del trace[:]
        try:
            if case.get("engine"):
                outputs = run_steps(llm, case, inputs)
            else:
                outputs = run_generate(llm, case["requests"], inputs)
        except Exception as e:
            doc["cases"][case["name"]] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            continue
        after = counters(llm)
        doc["cases"][case["name"]] = {
            "outputs": outputs,
            "stats": {k.removeprefix("vllm:"): after[k] - before[k] for k in COUNTERS},
            "schedule": list(trace),
            "wall_s": time.perf_counter() - t,
        }
        if case.get("reset_after"):
            doc["cases"][case["name"]]["reset"] = llm.reset_prefix_cache()
    if subscriber is not None:
        subscriber.drain()
        doc["kv_events"] = {"live": subscriber.live, "replayed": subscriber.replay()}
        subscriber.close()
    doc["total_s"] = time.perf_counter() - t0
    return doc


def compile_grammars_at_arrival() -> None:
    """Makes vLLM's StructuredOutputManager compile each grammar in ``grammar_init`` (as it
    does under ``external_launcher``) instead of in its thread pool: every request's grammar is
    then ready when it arrives, in both runs, so their schedules compare step by step (with
    asynchronous compilation, which steps a request waits for its grammar depends on timing)."""
    from vllm.v1.structured_output import StructuredOutputManager

    init = StructuredOutputManager.__init__

    def sync_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self._use_async_grammar_compilation = False

    StructuredOutputManager.__init__ = sync_init


def main() -> None:
    run_and_exit(serve)


def run_and_exit(run: Any) -> None:
    """Runs ``run(spec)`` on the JSON spec of ``argv[1]``, writes its result (or the error) to
    ``spec["out"]`` and exits at once (an in-process engine's teardown is slow and noisy)."""
    spec = json.loads(sys.argv[1])
    try:
        doc = run(spec)
    except BaseException as e:
        doc = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    with open(spec["out"], "w") as f:
        json.dump(doc, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
