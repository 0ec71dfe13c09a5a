#!/usr/bin/env python3
"""Replay a ``dflash-rs bench`` workload on vLLM's V1 ``Scheduler``, offline, and print JSON.

Runs in another interpreter (a venv with vLLM installed; written against vLLM 0.33), so it
imports only the standard library, numpy, vLLM and its stdlib-only sibling file
``offline_models.py``, never dflash_rs. ``dflash-rs bench --baseline-python PY`` writes a spec
file and runs ``PY vllm_driver.py SPEC``; the result JSON goes to stdout (everything vLLM
prints goes to stderr).

The spec file holds the workload parameters and a list of configs (mode, method, N, seed, block
fraction). Prompts, max_tokens, bonus tokens, acceptance counts and drafts come from numpy
generators seeded exactly as on the dflash-rs side, drawn per position of vLLM's batch, so both
schedulers replay the same trace. The first prompts of every seed are hashed (sha256 of the
int64 tokens) so the caller can check that both sides generated identical prompts.

vLLM is built as in its unit tests: the config.json-only model directories of
``offline_models.py`` in a temp dir (a tiny Llama target; DFlash and EAGLE drafts), a CPU
``DeviceConfig`` (no GPU platform needed), a ``KVCacheConfig`` of one full-attention group with
the requested number of blocks, and the request block hasher that EngineCore uses. Timed per
step with the spec's clock: ``schedule`` (+ ``get_grammar_bitmask``), ``update_from_output``
and ``update_draft_token_ids``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time

for _k, _v in (
    ("HF_HUB_OFFLINE", "1"),
    ("TRANSFORMERS_OFFLINE", "1"),
    ("VLLM_NO_USAGE_STATS", "1"),
    ("DO_NOT_TRACK", "1"),
    ("VLLM_LOGGING_LEVEL", "ERROR"),
    ("TORCH_CPP_LOG_LEVEL", "ERROR"),
):
    os.environ.setdefault(_k, _v)

import warnings  # noqa: E402

warnings.simplefilter("ignore")

import numpy as np  # noqa: E402

if __package__:  # imported as dflash_rs.bench.vllm_driver
    from .offline_models import VOCAB, write_model_dirs
else:  # run as a script (the usual way): the sibling file, found beside this one
    from offline_models import VOCAB, write_model_dirs

FIRST = 3
PHASES = ("schedule", "grammar", "update", "drafts", "admit", "total")
#: The draft models the driver replays (``offline_models.DRAFTS`` holds their configs).
DRAFTS = ("eagle", "dflash")


class Vllm:
    """vLLM's classes, imported once, and a factory of offline schedulers."""

    def __init__(self, p, root):
        t0 = time.perf_counter()
        import torch
        import vllm
        from vllm import config as vc
        from vllm.sampling_params import SamplingParams
        from vllm.utils.gc_utils import freeze_gc_heap
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        self.import_s = time.perf_counter() - t0
        self.p = p
        self.dirs = write_model_dirs(root, DRAFTS)
        self.torch, self.vllm, self.vc = torch, vllm, vc
        self.SamplingParams, self.Request = SamplingParams, Request
        self.freeze_gc_heap = freeze_gc_heap
        self.get_hash_fn_by_name = get_hash_fn_by_name
        self.get_request_block_hasher = get_request_block_hasher
        self.vllm_series = tuple(int(x) for x in vllm.__version__.split(".")[:2])
        self.init_none_hash = init_none_hash
        self.Scheduler = Scheduler
        self.kv = (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec)
        self.DraftTokenIds, self.ModelRunnerOutput = DraftTokenIds, ModelRunnerOutput
        self.StructuredOutputManager = StructuredOutputManager

    def scheduler(self, method, num_blocks, max_num_seqs):
        p, vc = self.p, self.vc
        model = vc.ModelConfig(
            model=self.dirs["target"],
            dtype="float16",
            seed=0,
            skip_tokenizer_init=True,
            max_model_len=p["max_model_len"],
        )
        parallel = vc.ParallelConfig()
        spec = None
        if method != "none":
            if method != "ngram" and method not in self.dirs:
                raise SystemExit(f"vllm_driver: no draft config for method {method!r}")
            spec = vc.SpeculativeConfig(
                method=method,
                num_speculative_tokens=p["K"],
                model="ngram" if method == "ngram" else self.dirs[method],
                target_model_config=model,
                target_parallel_config=parallel,
            )
        cache = vc.CacheConfig(
            block_size=p["block_size"],
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=True,
        )
        config = vc.VllmConfig(
            model_config=model,
            cache_config=cache,
            parallel_config=parallel,
            scheduler_config=vc.SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=p["max_num_batched_tokens"],
                max_model_len=p["max_model_len"],
                enable_chunked_prefill=True,
                async_scheduling=False,
                is_encoder_decoder=model.is_encoder_decoder,
            ),
            speculative_config=spec,
            device_config=vc.DeviceConfig(device="cpu"),
        )
        FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec = self.kv
        layer = FullAttentionSpec(
            block_size=p["block_size"], num_kv_heads=1, head_size=1, dtype=self.torch.float32
        )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], layer)],
        )
        cache.num_gpu_blocks = num_blocks
        sched = self.Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            block_size=p["block_size"],
            log_stats=True,
            structured_output_manager=self.StructuredOutputManager(config),
        )
        hash_fn = self.get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        self.init_none_hash(hash_fn)
        # Lookahead block hashes are new in vLLM 0.33 (this driver stands alone, without the
        # package's compatibility module: it runs in a venv that may only hold vLLM).
        lookahead = (config.num_hash_lookahead_tokens,) if self.vllm_series >= (0, 33) else ()
        hasher = self.get_request_block_hasher(p["block_size"], hash_fn, *lookahead)
        return sched, hasher

    def request(self, rid, prompt, max_tokens, hasher):
        return self.Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=self.SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=hasher,
        )


class Prompts:
    """The prompt stream of dflash_rs.bench.workload, regenerated from the same seed."""

    def __init__(self, p, seed):
        self.p = p
        self.rng = np.random.default_rng(seed)
        self.prefix = self.rng.integers(FIRST, VOCAB, p["prefix_len"])
        self.i = 0

    def array(self, i):
        p, rng = self.p, self.rng
        if i % 2 == 0:
            top = max(p["min_prompt"], p["max_prompt"] - p["prefix_len"])
            n = int(rng.integers(p["min_prompt"], top + 1))
            return np.concatenate((self.prefix, rng.integers(FIRST, VOCAB, n)))
        n = int(rng.integers(p["min_prompt"], p["max_prompt"] + 1))
        return rng.integers(FIRST, VOCAB, n)

    def next(self):
        i = self.i
        self.i += 1
        return f"r{i}", self.array(i).tolist()


def prompt_digests(p, seed, count):
    gen = Prompts(p, seed)
    return [
        hashlib.sha256(np.asarray(gen.array(i), dtype="<i8").tobytes()).hexdigest()
        for i in range(count)
    ]


def percentiles(ns):
    if not ns:
        return None
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {
        "p50_us": float(np.percentile(us, 50)),
        "p90_us": float(np.percentile(us, 90)),
        "p99_us": float(np.percentile(us, 99)),
        "mean_us": float(us.mean()),
        "max_us": float(us.max()),
        "n": int(us.size),
    }


def replay(v, cfg):
    """One simulation of one config; returns per-phase percentiles and per-step means."""
    p = v.p
    now = time.perf_counter_ns if p["clock"] == "wall" else time.thread_time_ns
    mode, method, n, seed = cfg["mode"], cfg["method"], cfg["n"], cfg["seed"]
    serve = mode in ("serve", "preempt")
    k = p["K"] if method != "none" else 0
    gen_len = p["max_tokens"] if serve else p["decode_max_tokens"]
    per_req = math.ceil((p["max_prompt"] + gen_len + (k + 1 if k else 0) + 1) / p["block_size"])
    num_blocks = max(64, int(n * (per_req + 1) * cfg.get("block_frac", 1.0)))
    sched, hasher = v.scheduler(method, num_blocks, max(p["max_num_seqs"], n))
    k = sched.num_spec_tokens
    prompts = Prompts(p, seed)
    rng = np.random.default_rng(seed + 7919)

    v.freeze_gc_heap()
    if p["gc"] == "off":
        gc.disable()
    unprefilled = set()
    for _ in range(n):
        max_tokens = int(rng.integers(1, p["max_tokens"] + 1)) if serve else gen_len
        rid, prompt = prompts.next()
        unprefilled.add(rid)
        sched.add_request(v.request(rid, prompt, max_tokens, hasher))

    times = {ph: [] for ph in PHASES}
    per_step = {"sched_reqs": [], "sched_tokens": [], "running": [], "preempted": []}
    state, warmup_left, steps, stop = "fill", p["warmup_steps"], 0, "measure_steps"
    preempted_total = 0
    while True:
        steps += 1
        if steps > p["max_sim_steps"]:
            stop = "max_sim_steps"
            break
        t0 = now()
        so = sched.schedule()
        t1 = now()
        sched.get_grammar_bitmask(so)
        t2 = now()

        counts = so.num_scheduled_tokens
        rids = list(counts)
        m = len(rids)
        drafts_in = so.scheduled_spec_decode_tokens
        bonus = rng.integers(FIRST, VOCAB, m).tolist() if m else []
        if k:
            if p["accept"] == "uniform":
                accept = rng.integers(0, k + 1, m).tolist() if m else []
            else:
                accept = [k if p["accept"] == "all" else 0] * m
        sampled = []
        for i, rid in enumerate(rids):
            if sched.requests[rid].is_prefill_chunk:
                sampled.append([])
                continue
            unprefilled.discard(rid)
            proposed = drafts_in.get(rid)
            if proposed:
                sampled.append([*proposed[: min(accept[i], len(proposed))], bonus[i]])
            else:
                sampled.append([bonus[i]])
        mro = v.ModelRunnerOutput(
            req_ids=rids,
            req_id_to_index={rid: i for i, rid in enumerate(rids)},
            sampled_token_ids=sampled,
        )
        t3 = now()
        outputs = sched.update_from_output(so, mro)
        t4 = now()

        t_drafts = 0
        if k and m and not so.skip_drafts:
            live = []
            for rid in rids:
                req = sched.requests.get(rid)
                if req is not None and not req.is_prefill_chunk and not req.is_finished():
                    live.append(rid)
            if live:
                tokens = rng.integers(FIRST, VOCAB, (len(live), k)).tolist()
                ids = v.DraftTokenIds(req_ids=live, draft_token_ids=tokens)
                t5 = now()
                sched.update_draft_token_ids(ids)
                t_drafts = now() - t5

        finished = sum(
            1 for eco in outputs.values() for o in eco.outputs if o.finish_reason is not None
        )
        npre = len(so.preempted_req_ids or ())
        preempted_total += npre
        t_admit = 0
        if serve and finished:
            for _ in range(finished):
                rid, prompt = prompts.next()
                t6 = now()
                sched.add_request(v.request(rid, prompt, p["max_tokens"], hasher))
                t_admit += now() - t6

        if state == "measure":
            for ph, dt in (
                ("schedule", t1 - t0),
                ("grammar", t2 - t1),
                ("update", t4 - t3),
                ("drafts", t_drafts),
                ("admit", t_admit),
                ("total", (t2 - t0) + (t4 - t3) + t_drafts),
            ):
                times[ph].append(dt)
            per_step["sched_reqs"].append(m)
            per_step["sched_tokens"].append(so.total_num_scheduled_tokens)
            per_step["running"].append(len(sched.running))
            per_step["preempted"].append(npre)
            if len(times["schedule"]) >= p["measure_steps"]:
                break
            if not serve and finished:
                stop = "a request finished"
                break
        elif state == "fill" and not unprefilled:
            state = "warmup" if warmup_left > 0 else "measure"
        elif state == "warmup":
            warmup_left -= 1
            if warmup_left <= 0:
                state = "measure"
        if not sched.has_unfinished_requests():
            stop = "drained"
            break
    gc.enable()
    gc.unfreeze()
    result = {
        **cfg,
        "K": k,
        "num_blocks": num_blocks,
        "sim_steps": steps,
        "measured_steps": len(times["schedule"]),
        "stop_reason": stop,
        "preempted_total": preempted_total,
        "timings": {ph: percentiles(x) for ph, x in times.items()},
        "means": {key: (float(np.mean(x)) if x else None) for key, x in per_step.items()},
    }
    del sched
    gc.collect()
    return result


def main(argv):
    if len(argv) != 1:
        print("usage: vllm_driver.py SPEC.json  (written by dflash-rs bench)", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    p = spec["params"]
    # vLLM and torch may print on stdout at import; keep stdout for the JSON result alone.
    stdout = os.dup(1)
    os.dup2(2, 1)
    root = tempfile.mkdtemp(prefix="dflash-rs-vllm-models-")
    try:
        v = Vllm(p, root)
        runs = []
        for rep in range(spec.get("reps", 1)):
            for cfg in spec["configs"]:
                t0 = time.perf_counter()
                r = replay(v, cfg)
                r["rep"] = rep
                r["wall_s"] = time.perf_counter() - t0
                runs.append(r)
                print(
                    f"vllm rep {rep} {cfg['mode']} {cfg['method']} N={cfg['n']}: total p50 "
                    f"{(r['timings']['total'] or {}).get('p50_us', float('nan')):.1f}us",
                    file=sys.stderr,
                    flush=True,
                )
        seeds = sorted({cfg["seed"] for cfg in spec["configs"]})
        count = spec.get("hash_prompts", 0)
        doc = {
            "versions": {
                "vllm": v.vllm.__version__,
                "torch": v.torch.__version__,
                "numpy": np.__version__,
                "python": platform.python_version(),
            },
            "import_s": v.import_s,
            "prompt_sha256": {str(s): prompt_digests(p, s, count) for s in seeds},
            "runs": runs,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        sys.stdout.flush()
        os.dup2(stdout, 1)
    json.dump(doc, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
