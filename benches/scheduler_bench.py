#!/usr/bin/env python3
"""Per-step CPU cost of dflash-rs's Scheduler, driven through Python like an engine.

This is the dflash-rs side of the side-by-side comparison with vLLM 0.33's Python scheduler
(`shared/baselines/vllm/bench_vllm_scheduler.py`, "the harness"). It re-implements the
harness's workload generator and step loop faithfully -- same prompts, same random draws in
the same order, same acceptance model, same measurement windows -- so that, for the same
`--seed`, both schedulers see the identical workload (`--trace-out` writes the same per-step
JSONL as the harness, so the scheduling decisions can be diffed; `--dump-prompt-hashes` prints
hashes of the generated prompts, to check them against the harness's generator).

Per simulated step (all timed separately with perf_counter_ns):

    so = sched.schedule()                                   # "schedule"
    so.scheduled_spec_decode_tokens (lists path) or         # "spec" (built on access)
       so.num_spec_tokens_array (arrays path)
    <fabricated model runner output>                        # not timed
    sched.update_from_output(so, mro)                       # "update"
    sched.update_draft_token_ids...(drafts)                 # "drafts"
    <admit replacements: Request() + add_request()>         # "admit" (per step and per request)

"total" = schedule + spec + update + drafts (the harness's total is schedule +
get_grammar_bitmask + update + drafts; dflash-rs has no grammar step).

Two input paths, each its own simulation of the same workload:
  arrays: ModelRunnerOutput.from_arrays(so.req_ids, tokens_int32, counts_int32),
          update_draft_token_ids_from_arrays(so, tokens_int32, counts_int32), prompts as int32
          arrays; the runner's accepted drafts come from the drafts it proposed, cut to
          so.num_spec_tokens_array (timed as "spec"; builds without it: tokens scheduled - 1).
  lists:  ModelRunnerOutput(so.req_ids, sampled_token_ids=[[...], ...]),
          update_draft_token_ids({req_id: [...]}), prompts as lists, accepted drafts read from
          so.scheduled_spec_decode_tokens as vLLM's engine does (timed as "spec").

Modes:
  decode : N prompts admitted at once, max_tokens 2048; window = 150 steps after every request
           finished prefill + 20 warmup steps (pure decode of N running requests).
  serve  : closed loop, N in flight, max_tokens 256 (initial cohort uniform 1..256), finished
           requests replaced before the next step; window after the initial cohort's prefill +
           20 warmup steps.
  preempt: serve at --preempt-n with --preempt-block-frac (25%) of the blocks.
  micro  : admitting one --micro-prompt-len (1,100) token request: Request() + add_request()
           (prompt block hashing happens in add_request, in Rust), per request, list and array
           prompts; also a 16-token prompt to separate the fixed cost from hashing.

Example:
  .venv/bin/python benches/scheduler_bench.py --n-reqs 64,256,1024 --spec dflash \
      --modes decode,serve,preempt,micro --reps 3 --json bench_sched.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import os
import platform
import sys
import time

import numpy as np

VOCAB = 32000
FIRST_TOKEN = 3  # sampled/prompt tokens are drawn from [3, VOCAB), as in the harness
pc = time.perf_counter_ns
PHASES = ("schedule", "spec", "update", "drafts", "admit", "admit_req", "total")


# --------------------------------------------------------------------------
# workload (a faithful re-implementation of the harness's Workload.prompt)
# --------------------------------------------------------------------------
class Workload:
    """Deterministic prompt stream: even ids share a --prefix-len system prefix.

    Draws from `np.random.default_rng(seed)` exactly as the harness does: first the prefix,
    then per request i one length draw and one token draw.
    """

    def __init__(self, args, seed: int):
        self.args = args
        self.rng = np.random.default_rng(seed)
        self.prefix_arr = self.rng.integers(FIRST_TOKEN, VOCAB, args.prefix_len)
        self.prefix = self.prefix_arr.tolist()
        self.counter = 0

    def prompt_array(self, i: int) -> np.ndarray:
        """Prompt i as an int64 array (the same values the harness turns into a list)."""
        a = self.args
        if i % 2 == 0:
            hi = max(a.min_prompt, a.max_prompt - a.prefix_len)
            tail = int(self.rng.integers(a.min_prompt, hi + 1))
            return np.concatenate((self.prefix_arr, self.rng.integers(FIRST_TOKEN, VOCAB, tail)))
        n = int(self.rng.integers(a.min_prompt, a.max_prompt + 1))
        return self.rng.integers(FIRST_TOKEN, VOCAB, n)

    def next(self, as_array: bool):
        """(request id, prompt) of the next request: an int32 array or a list of ints."""
        i = self.counter
        self.counter += 1
        p = self.prompt_array(i)
        return f"r{i}", (p.astype(np.int32) if as_array else p.tolist())


def blocks_per_req(a, max_gen: int, lookahead: int) -> int:
    return math.ceil((a.max_prompt + max_gen + lookahead + 1) / a.block_size) + 1


def prompt_hashes(args, seed: int, count: int) -> list[str]:
    """sha256 of each of the first `count` prompts (as int64 little-endian), for checking the
    generator against the harness's."""
    wl = Workload(args, seed)
    out = []
    for i in range(count):
        p = np.asarray(wl.prompt_array(i), dtype="<i8")
        out.append(hashlib.sha256(p.tobytes()).hexdigest())
    return out


# --------------------------------------------------------------------------
# statistics
# --------------------------------------------------------------------------
def summarize_ns(xs):
    if not xs:
        return None
    arr = np.asarray(xs, dtype=np.float64) / 1e3  # -> microseconds
    return {
        "p50_us": float(np.percentile(arr, 50)),
        "p90_us": float(np.percentile(arr, 90)),
        "p99_us": float(np.percentile(arr, 99)),
        "mean_us": float(arr.mean()),
        "max_us": float(arr.max()),
        "n": int(arr.size),
    }


def median(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.median(xs)) if xs else float("nan")


class GcCounter:
    def __init__(self):
        self.counts = [0, 0, 0]
        self.active = False

    def __call__(self, phase, info):
        if self.active and phase == "start":
            self.counts[info["generation"]] += 1


# --------------------------------------------------------------------------
# scheduler construction
# --------------------------------------------------------------------------
def build_scheduler(args, spec: str, num_blocks: int, max_num_seqs: int):
    import dflash_rs as d

    speculative = None
    if spec != "none":
        speculative = d.SpeculativeConfig(spec, args.num_spec_tokens)
    cfg = d.SchedulerConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        speculative=speculative,
        hash_algo=args.hash_algo,
    )
    return d.Scheduler(cfg)


def freeze_gc_heap():
    """What vLLM's freeze_gc_heap() does at engine start-up: collect, then freeze."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()


def perf_ctl(args, cmd: str):
    """With --perf-ctl CTL,ACK: tell `perf record -D -1 --control fifo:CTL,ACK` to sample only
    the measured windows (untimed fabrication still runs in them)."""
    if not args.perf_ctl:
        return
    ctl, ack = args.perf_ctl.split(",")
    fd = os.open(ctl, os.O_WRONLY)
    os.write(fd, (cmd + "\n").encode())
    os.close(fd)
    fd = os.open(ack, os.O_RDONLY)
    os.read(fd, 5)
    os.close(fd)


# --------------------------------------------------------------------------
# simulation (mirrors the harness's run_sim)
# --------------------------------------------------------------------------
def run_sim(
    args,
    mode: str,
    n: int,
    spec: str,
    seed: int,
    path: str,
    block_frac: float = 1.0,
    trace=None,
    check: bool = False,
    profiler=None,
):
    import dflash_rs as d

    arrays = path == "arrays"
    K = args.num_spec_tokens if spec != "none" else 0
    serve = mode in ("serve", "preempt")
    max_gen = args.max_tokens if serve else args.decode_max_tokens
    lookahead = K + 1 if K else 0  # the harness's block-count formula (all spec methods)
    need = n * blocks_per_req(args, max_gen, lookahead)
    num_blocks = max(64, int(need * block_frac))
    sched = build_scheduler(args, spec, num_blocks, max(args.max_num_seqs, n))
    wl = Workload(args, seed)
    rng = np.random.default_rng(seed + 7919)
    accept = args.accept
    Request = d.Request
    MRO = d.ModelRunnerOutput
    from_arrays = MRO.from_arrays

    freeze_gc_heap()
    if args.gc == "off":
        gc.disable()
    gcc = GcCounter()
    gc.callbacks.append(gcc)

    initial_pending: set[str] = set()
    for _ in range(n):
        mt = int(rng.integers(1, args.max_tokens + 1)) if serve else args.decode_max_tokens
        rid, prompt = wl.next(arrays)
        initial_pending.add(rid)
        sched.add_request(Request(rid, prompt, mt))

    # Drafts this "runner" proposed and the scheduler has not scheduled yet (arrays path: the
    # runner knows its own drafts and needs no dict from the scheduler).
    pending_drafts: dict[str, list[int]] = {}
    has_nspec = hasattr(d.SchedulerOutput, "num_spec_tokens_array")
    i32 = np.int32

    phase = "fill"
    warm_left = args.warmup_steps
    rec = {k: [] for k in PHASES}
    stats = {
        k: []
        for k in (
            "sched_reqs",
            "sched_tokens",
            "prefill_reqs",
            "running",
            "waiting",
            "preempted",
            "finished",
            "accepted",
            "drafted",
        )
    }
    steps = fill_steps = 0
    stop_reason = "measure_steps"
    total_finished = total_preempted = 0
    while True:
        steps += 1
        if steps > args.max_sim_steps:
            stop_reason = "max_sim_steps"
            break
        prof = profiler if phase == "measure" else None
        if prof is not None:
            prof.enable()
        t0 = pc()
        so = sched.schedule()
        t1 = pc()
        spec_map = nspec = None
        if not arrays:
            spec_map = so.scheduled_spec_decode_tokens
        elif has_nspec:
            nspec = so.num_spec_tokens_array
        t2 = pc()
        if prof is not None:
            prof.disable()

        # ---- fabricate the model runner output (not timed) ----
        rids = so.req_ids
        m = len(rids)
        nst = so.num_scheduled_tokens_array.tolist()
        ipc = so.is_prefill_chunk.tolist()
        if nspec is not None:
            nspec = nspec.tolist()
        npre = len(so.preempted_req_ids)
        if npre:
            for rid in so.preempted_req_ids:
                pending_drafts.pop(rid, None)
        # The harness draws bonus tokens, acceptance counts and drafts per position of vLLM's
        # batch, which is running order (then new requests). dflash-rs's batch is in
        # persistent block-table row order, so map each draw to the request vLLM would have
        # given it: the same request gets the same tokens on both sides.
        if args.draw_order == "vllm" and m:
            sched_set = set(rids)
            vpos = {
                rid: j
                for j, rid in enumerate(r for r in sched.running_request_ids() if r in sched_set)
            }
            if len(vpos) != m:  # not all scheduled requests are running: keep batch order
                vidx = list(range(m))
            else:
                vidx = [vpos[rid] for rid in rids]
        else:
            vidx = list(range(m))
        bonus = rng.integers(FIRST_TOKEN, VOCAB, m).tolist() if m else []
        if K:
            if accept == "uniform":
                accs = rng.integers(0, K + 1, m).tolist() if m else []
            elif accept == "all":
                accs = [K] * m
            else:
                accs = [0] * m
        sampled = []
        prefill_reqs = accepted = drafted = 0
        for i, rid in enumerate(rids):
            d_ = pending_drafts.pop(rid, None)
            if arrays:
                if nspec is not None:
                    st = d_[: nspec[i]] if d_ else None
                else:  # older builds: drafts scheduled = tokens scheduled - 1 (bonus)
                    st = d_[: max(0, nst[i] - 1)] if d_ else None
                if check:
                    ref = so.scheduled_spec_decode_tokens.get(rid)
                    assert (ref or None) == (st or None), (rid, ref, st)
            else:
                st = spec_map.get(rid)
            if nst[i] > 1 + (len(st) if st else 0):
                prefill_reqs += 1
            if ipc[i]:
                sampled.append([])
                continue
            if initial_pending and rid in initial_pending:
                initial_pending.discard(rid)
            v = vidx[i]
            if st:
                acc = min(accs[v], len(st))
                toks = list(st[:acc])
                toks.append(bonus[v])
                accepted += acc
                drafted += len(st)
            else:
                toks = [bonus[v]]
            sampled.append(toks)
        if arrays:
            counts = np.fromiter((len(t) for t in sampled), dtype=i32, count=m)
            flat = np.fromiter((x for t in sampled for x in t), dtype=i32, count=int(counts.sum()))
            mro = from_arrays(rids, flat, counts)
        else:
            mro = MRO(rids, sampled_token_ids=sampled)

        if prof is not None:
            prof.enable()
        t3 = pc()
        outs = sched.update_from_output(so, mro)
        t4 = pc()
        if prof is not None:
            prof.disable()

        finished_ids = {o.request_id for o in outs if o.finish_reason is not None}
        finished = len(finished_ids)

        # ---- drafts for the next step: K random tokens for every request that sampled ----
        td = 0
        if K and m:
            mask = [not ipc[i] and rid not in finished_ids for i, rid in enumerate(rids)]
            vorder = sorted(range(m), key=vidx.__getitem__)  # our batch indices, vLLM order
            d_ids = [rids[i] for i in vorder if mask[i]]
            if d_ids:
                dt = rng.integers(FIRST_TOKEN, VOCAB, (len(d_ids), K))
                dt_list = dt.tolist()
                for rid, row in zip(d_ids, dt_list):
                    pending_drafts[rid] = row
                if arrays:
                    dcounts = np.asarray(mask, dtype=i32) * i32(K)
                    dflat = np.fromiter(
                        (x for rid, keep in zip(rids, mask) if keep for x in pending_drafts[rid]),
                        dtype=i32,
                        count=len(d_ids) * K,
                    )
                    if prof is not None:
                        prof.enable()
                    t5 = pc()
                    sched.update_draft_token_ids_from_arrays(so, dflat, dcounts)
                    td = pc() - t5
                else:
                    ddict = dict(zip(d_ids, dt_list))
                    if prof is not None:
                        prof.enable()
                    t5 = pc()
                    sched.update_draft_token_ids(ddict)
                    td = pc() - t5
                if prof is not None:
                    prof.disable()
        for rid in finished_ids:
            pending_drafts.pop(rid, None)
        total_finished += finished
        total_preempted += npre

        # ---- admit replacements (serve: closed loop with N in the system) ----
        ta = 0
        admit_each = []
        if serve and finished:
            for _ in range(finished):
                rid, prompt = wl.next(arrays)  # prompt generation is not timed
                t6 = pc()
                sched.add_request(Request(rid, prompt, args.max_tokens))
                dt_ = pc() - t6
                ta += dt_
                admit_each.append(dt_)

        if trace is not None:
            trace.write(
                json.dumps(
                    {
                        "mode": mode,
                        "spec": spec,
                        "n": n,
                        "seed": seed,
                        "step": steps,
                        "phase": phase,
                        "sched_reqs": m,
                        "sched_tokens": so.total_num_scheduled_tokens,
                        "prefill_reqs": prefill_reqs,
                        "preempted": npre,
                        "finished": finished,
                        "accepted": accepted,
                        "drafted": drafted,
                        "path": path,
                    }
                )
                + "\n"
            )

        if phase == "measure":
            ts, tsp, tu = t1 - t0, t2 - t1, t4 - t3
            rec["schedule"].append(ts)
            rec["spec"].append(tsp)
            rec["update"].append(tu)
            rec["drafts"].append(td)
            rec["admit"].append(ta)
            rec["admit_req"].extend(admit_each)
            rec["total"].append(ts + tsp + tu + td)
            stats["sched_reqs"].append(m)
            stats["sched_tokens"].append(so.total_num_scheduled_tokens)
            stats["prefill_reqs"].append(prefill_reqs)
            nrun, nwait = sched.get_request_counts()
            stats["running"].append(nrun)
            stats["waiting"].append(nwait)
            stats["preempted"].append(npre)
            stats["finished"].append(finished)
            stats["accepted"].append(accepted)
            stats["drafted"].append(drafted)
            if len(rec["schedule"]) >= args.measure_steps:
                break
            if not serve and finished:
                stop_reason = "a request finished"
                break
        elif phase == "fill":
            fill_steps += 1
            if not initial_pending:
                phase = "warmup" if warm_left > 0 else "measure"
                if phase == "measure":
                    gcc.active = True
                    perf_ctl(args, "enable")
        elif phase == "warmup":
            warm_left -= 1
            if warm_left <= 0:
                phase = "measure"
                gcc.active = True
                perf_ctl(args, "enable")
        if not sched.has_unfinished_requests():
            stop_reason = "drained"
            break

    perf_ctl(args, "disable")
    gc.callbacks.remove(gcc)
    gc.enable()
    gc.unfreeze()
    if check:
        sched.check_invariants()
    s = sched.stats()
    result = {
        "mode": mode,
        "spec": spec,
        "K": K,
        "path": path,
        "lookahead": sched.lookahead_tokens,
        "n": n,
        "seed": seed,
        "num_blocks": num_blocks,
        "block_frac": block_frac,
        "fill_steps": fill_steps,
        "sim_steps": steps,
        "measured_steps": len(rec["schedule"]),
        "stop_reason": stop_reason,
        "gc_collections_in_window": gcc.counts,
        "finished_total": total_finished,
        "preempted_total": total_preempted,
        "timings": {k: summarize_ns(v) for k, v in rec.items()},
        "means": {k: (float(np.mean(v)) if v else None) for k, v in stats.items()},
        "scheduler_stats_whole_run": {k: v for k, v in s.items() if not isinstance(v, list)},
    }
    del sched, wl
    gc.collect()
    return result


# --------------------------------------------------------------------------
# micro: admitting one request
# --------------------------------------------------------------------------
def micro_admit(args, seed: int, iters: int):
    """Request() + add_request() of fresh prompts, each call timed. Prompts are generated
    beforehand; the scheduler only queues them (add_request hashes the prompt blocks)."""
    import dflash_rs as d

    out = {}
    rng = np.random.default_rng(seed)
    for L in sorted({args.micro_prompt_len, 16}):
        prompts = rng.integers(FIRST_TOKEN, VOCAB, (iters, L))
        for path in ("arrays", "lists"):
            ps = [p.astype(np.int32) for p in prompts] if path == "arrays" else prompts.tolist()
            sched = build_scheduler(args, "dflash" if args.num_spec_tokens else "none", 4096, 1024)
            Request = d.Request
            # warm up the code paths on a throwaway request
            sched.add_request(Request("warm", ps[0], 16))
            times = []
            t_req = []
            gc.collect()
            for i, p in enumerate(ps):
                rid = f"m{i}"
                t0 = pc()
                r = Request(rid, p, 16)
                t1 = pc()
                sched.add_request(r)
                t2 = pc()
                times.append(t2 - t0)
                t_req.append(t1 - t0)
            out[f"admit_{L}_{path}"] = summarize_ns(times)
            out[f"request_ctor_{L}_{path}"] = summarize_ns(t_req)
            del sched
    out["prompt_lens"] = sorted({args.micro_prompt_len, 16})
    out["iters"] = iters
    return out


# --------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------
def machine_info():
    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "nproc": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def aggregate(runs):
    """Median over repetitions of each per-run statistic."""
    agg = {}
    for key in PHASES:
        for stat in ("p50_us", "p99_us", "mean_us"):
            vals = [r["timings"][key][stat] for r in runs if r["timings"][key]]
            agg[f"{key}_{stat}"] = median(vals)
    for key in runs[0]["means"]:
        agg[f"mean_{key}"] = median([r["means"][key] for r in runs])
    agg["measured_steps"] = median([r["measured_steps"] for r in runs])
    agg["preempted_total"] = median([r["preempted_total"] for r in runs])
    agg["gc_gen2_in_window"] = median([r["gc_collections_in_window"][2] for r in runs])
    agg["reps"] = len(runs)
    return agg


def _f(x, nd=1):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.{nd}f}"


def fmt_table(rows):
    hdr = [
        "mode",
        "spec",
        "N",
        "path",
        "run",
        "tok/step",
        "pf/step",
        "sched p50",
        "sched p99",
        "spec p50",
        "update p50",
        "update p99",
        "drafts p50",
        "total p50",
        "total p99",
        "admit/req p50",
        "preempt",
        "gc2",
        "steps",
    ]
    table = [hdr]
    for (mode, spec, n, path), agg in rows:
        table.append(
            [
                mode,
                spec,
                str(n),
                path,
                _f(agg["mean_running"], 0),
                _f(agg["mean_sched_tokens"], 0),
                _f(agg["mean_prefill_reqs"]),
                _f(agg["schedule_p50_us"]),
                _f(agg["schedule_p99_us"]),
                _f(agg["spec_p50_us"]),
                _f(agg["update_p50_us"]),
                _f(agg["update_p99_us"]),
                _f(agg["drafts_p50_us"]),
                _f(agg["total_p50_us"]),
                _f(agg["total_p99_us"]),
                _f(agg["admit_req_p50_us"]),
                _f(agg["preempted_total"], 0),
                _f(agg["gc_gen2_in_window"], 0),
                _f(agg["measured_steps"], 0),
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(hdr))]
    lines = []
    for j, r in enumerate(table):
        lines.append("| " + " | ".join(c.rjust(widths[i]) for i, c in enumerate(r)) + " |")
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def parse_list(s, typ=str):
    return [typ(x) for x in s.split(",") if x.strip()]


def core_info():
    import dflash_rs

    info = {"dflash_rs": dflash_rs.__version__, "dflash_rs_path": dflash_rs.__file__}
    so = os.path.join(os.path.dirname(dflash_rs.__file__), "_core.abi3.so")
    try:
        st = os.stat(so)
        info["core_so_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))
        with open(so, "rb") as f:
            info["core_so_sha256"] = hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        pass
    return info


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--n-reqs", default="64,256,1024", help="concurrency levels N")
    p.add_argument("--spec", default="dflash", help="spec-decode configs: none and/or dflash")
    p.add_argument(
        "--modes",
        default="decode,serve,preempt,micro",
        help="decode, serve, preempt (serve at --preempt-n, few blocks), micro",
    )
    p.add_argument(
        "--paths",
        default="arrays,lists",
        help="input paths: arrays (flat int32 arrays) and/or lists (lists + dict)",
    )
    p.add_argument("--num-spec-tokens", type=int, default=8, help="K")
    p.add_argument("--accept", default="uniform", choices=["uniform", "all", "none"])
    p.add_argument("--reps", type=int, default=3, help="repetitions (medians reported)")
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--measure-steps", type=int, default=150)
    p.add_argument("--max-sim-steps", type=int, default=5000)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=1024, help="raised to N when N is larger")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--max-tokens", type=int, default=256, help="serve-mode max_tokens")
    p.add_argument("--decode-max-tokens", type=int, default=2048)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--min-prompt", type=int, default=128)
    p.add_argument("--max-prompt", type=int, default=2048)
    p.add_argument("--preempt-n", type=int, default=256)
    p.add_argument("--preempt-block-frac", type=float, default=0.25)
    p.add_argument("--micro-iters", type=int, default=2000, help="admissions per micro rep")
    p.add_argument("--micro-prompt-len", type=int, default=1100)
    p.add_argument(
        "--micro-seed",
        type=int,
        default=None,
        help="seed of the micro prompts (default: --seed + rep)",
    )
    p.add_argument(
        "--hash-algo",
        default="sha256",
        choices=["sha256", "blake3", "xxh3_128"],
        help="prefix-cache block hash (vLLM's default is sha256)",
    )
    p.add_argument("--gc", default="engine", choices=["engine", "off"])
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall: perf_counter_ns (as the harness); cpu: thread_time_ns, which "
        "does not count time the thread is descheduled on a busy machine "
        "(about 0.7 us per reading on this VM, inflating each phase slightly)",
    )
    p.add_argument(
        "--draw-order",
        default="vllm",
        choices=["vllm", "batch"],
        help="vllm: map the per-position random draws to requests in vLLM's batch "
        "order (running order), so each request gets the same tokens as in "
        "the harness; batch: in dflash-rs's batch order",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", default=None, help="write all results here")
    p.add_argument(
        "--trace-out",
        default=None,
        help="JSONL, one line per simulated step (same fields as the harness's)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="cross-check the runner's draft bookkeeping against "
        "scheduled_spec_decode_tokens every step and run check_invariants() "
        "at the end (slower; timings then include nothing extra but the "
        "untimed fabrication is slower)",
    )
    p.add_argument(
        "--profile-out",
        default=None,
        help="cProfile the timed calls of the measured steps (inflated timings)",
    )
    p.add_argument(
        "--perf-ctl",
        default=None,
        metavar="CTL,ACK",
        help="fifos of `perf record -D -1 --control fifo:CTL,ACK`: profile only the "
        "measured windows",
    )
    p.add_argument(
        "--dump-prompt-hashes",
        type=int,
        default=0,
        metavar="COUNT",
        help="print sha256 of the first COUNT prompts for each config seed and exit",
    )
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)

    global pc
    pc = time.perf_counter_ns if args.clock == "wall" else time.thread_time_ns
    n_list = parse_list(args.n_reqs, int)
    spec_list = parse_list(args.spec)
    modes = parse_list(args.modes)
    paths = parse_list(args.paths)

    if args.dump_prompt_hashes:
        seeds = sorted(
            {args.seed + 1000 * n for n in n_list}
            | ({args.seed + 1000 * args.preempt_n} if args.preempt_n else set())
        )
        doc = {str(s): prompt_hashes(args, s, args.dump_prompt_hashes) for s in seeds}
        print(json.dumps(doc))
        return

    t_start = time.perf_counter()
    info = machine_info()
    import dflash_rs  # noqa: F401

    versions = {"numpy": np.__version__, "python": platform.python_version(), **core_info()}
    if not args.quiet:
        print(
            f"dflash_rs {versions['dflash_rs']} (core {versions.get('core_so_sha256')}, "
            f"{versions.get('core_so_mtime')})  numpy {np.__version__}  python "
            f"{platform.python_version()}",
            flush=True,
        )

    sim_modes = [m for m in modes if m in ("decode", "serve")]
    configs = [(m, s, n) for m in sim_modes for s in spec_list for n in n_list]
    if "preempt" in modes and args.preempt_n > 0:
        configs += [("preempt", s, args.preempt_n) for s in spec_list]

    trace = open(args.trace_out, "w") if args.trace_out else None
    profiler = None
    if args.profile_out:
        import cProfile

        profiler = cProfile.Profile()
    runs = {(c[0], c[1], c[2], path): [] for c in configs for path in paths}
    micro_runs = []
    for rep in range(args.reps):
        for mode, spec, n in configs:
            for path in paths:
                frac = args.preempt_block_frac if mode == "preempt" else 1.0
                t0 = time.perf_counter()
                r = run_sim(
                    args,
                    mode,
                    n,
                    spec,
                    seed=args.seed + 1000 * n,
                    path=path,
                    block_frac=frac,
                    trace=trace,
                    check=args.check,
                    profiler=profiler,
                )
                r["rep"] = rep
                r["wall_s"] = time.perf_counter() - t0
                runs[(mode, spec, n, path)].append(r)
                t = r["timings"]
                if not args.quiet:
                    print(
                        f"rep {rep} {mode:7s} {spec:6s} N={n:5d} {path:6s}: sched p50 "
                        f"{t['schedule']['p50_us']:8.1f}us  update p50 "
                        f"{t['update']['p50_us']:8.1f}us  drafts p50 "
                        f"{t['drafts']['p50_us']:7.1f}us  total p50 "
                        f"{t['total']['p50_us']:8.1f}us  steps {r['measured_steps']} "
                        f"({r['stop_reason']}), fill {r['fill_steps']}, preempt "
                        f"{r['preempted_total']}, wall {r['wall_s']:.1f}s",
                        flush=True,
                    )
        if "micro" in modes:
            mseed = args.seed + rep if args.micro_seed is None else args.micro_seed
            mr = micro_admit(args, mseed, args.micro_iters)
            micro_runs.append(mr)
            if not args.quiet:
                print(
                    f"rep {rep} micro: "
                    + ", ".join(
                        f"{k}={v['p50_us']:.2f}us" for k, v in mr.items() if k.startswith("admit_")
                    ),
                    flush=True,
                )
    if trace:
        trace.close()

    rows = [(k, aggregate(v)) for k, v in runs.items() if v]
    micro_agg = {}
    if micro_runs:
        for k, v in micro_runs[0].items():
            if isinstance(v, dict):
                micro_agg[k] = {
                    s: median([m[k][s] for m in micro_runs])
                    for s in ("p50_us", "p99_us", "mean_us")
                }
    print()
    print(
        f"Per-step CPU time of dflash-rs's Scheduler through Python, microseconds, median "
        f"over {args.reps} reps (p50/p99 within each rep's measured window)"
    )
    if rows:
        print(fmt_table(rows))
        print(
            "spec: so.scheduled_spec_decode_tokens (lists) or so.num_spec_tokens_array "
            "(arrays); total: schedule + spec + update_from_output + "
            "update_draft_token_ids; admit/req: Request() + add_request() per admitted "
            "request."
        )
    if micro_agg:
        print()
        print(
            f"Admission, Request() + add_request(), microseconds per request, median over "
            f"{len(micro_runs)} reps of {args.micro_iters} admissions:"
        )
        for k, v in micro_agg.items():
            print(
                f"  {k:28s} p50 {v['p50_us']:8.2f}  p99 {v['p99_us']:8.2f}  "
                f"mean {v['mean_us']:8.2f}"
            )
    if profiler is not None:
        import pstats

        profiler.dump_stats(args.profile_out)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
    total_s = time.perf_counter() - t_start
    print(f"\ntotal wall time {total_s:.1f}s")
    try:
        info["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    if args.json_out:
        doc = {
            "what": "dflash-rs Scheduler CPU cost per step through Python (offline, "
            "fabricated model outputs, workload of the vLLM anchor harness)",
            "versions": versions,
            "machine": info,
            "args": vars(args),
            "argv": sys.argv,
            "total_wall_s": total_s,
            "aggregate": [
                {"mode": k[0], "spec": k[1], "n": k[2], "path": k[3], **agg} for k, agg in rows
            ],
            "micro_aggregate": micro_agg,
            "runs": [r for v in runs.values() for r in v],
            "micro_runs": micro_runs,
        }
        with open(args.json_out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.json_out}")


if __name__ == "__main__":
    main()
