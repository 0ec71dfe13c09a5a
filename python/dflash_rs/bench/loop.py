"""The step loop of the scheduler benchmark: drives dflash-rs's ``Scheduler`` like an engine
(schedule, fabricated model output, update_from_output, drafts, admissions) and times each
scheduler call; plus the ``micro`` admission benchmark."""

from __future__ import annotations

import gc
import json
import os
import time

import numpy as np

from dflash_rs.bench.stats import PHASES, GcCounter, summarize_ns
from dflash_rs.bench.workload import FIRST_TOKEN, VOCAB, Workload, blocks_per_req

CLOCKS = {"wall": time.perf_counter_ns, "cpu": time.thread_time_ns}
#: The micro benchmark also admits prompts of this length, besides --micro-prompt-len.
MICRO_SHORT_PROMPT_LEN = 16


def clock(args):
    """The timer of ``--clock``: perf_counter_ns (wall, as the harness) or thread_time_ns."""
    return CLOCKS[getattr(args, "clock", "wall")]


def build_scheduler_config(args, spec: str, num_blocks: int, max_num_seqs: int):
    """dflash-rs's SchedulerConfig as the harness configures vLLM's."""
    import dflash_rs as d

    speculative = None
    if spec != "none":
        speculative = d.SpeculativeConfig(spec, args.num_spec_tokens)
    return d.SchedulerConfig(
        num_blocks=num_blocks,
        block_size=args.block_size,
        # At most what the pool holds (a smaller pool is refused, as vLLM's engine refuses it;
        # the harness drives vLLM's Scheduler class, which does not check). Every request of
        # the workload fits the pool, so the cap changes no schedule.
        max_model_len=min(args.max_model_len, (num_blocks - 1) * args.block_size),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        speculative=speculative,
        hash_algo=args.hash_algo,
    )


def build_scheduler(args, spec: str, num_blocks: int, max_num_seqs: int):
    """dflash-rs's Scheduler configured as the harness configures vLLM's."""
    import dflash_rs as d

    return d.Scheduler(build_scheduler_config(args, spec, num_blocks, max_num_seqs))


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

    pc = clock(args)
    arrays = path == "arrays"
    # The README's loop (`lists`): the runner knows its own drafts, as on the arrays path, and
    # the update's RequestOutputs are read as the README reads them. `lists_spec_dict` takes the
    # drafts to verify from `scheduled_spec_decode_tokens`, as vLLM's engine does, and reads
    # only the finished outputs.
    own_drafts = path != "lists_spec_dict"
    read_outputs = path == "lists"
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

    # Drafts this "runner" proposed and the scheduler has not scheduled yet (arrays and lists
    # paths: the runner knows its own drafts and needs no dict from the scheduler).
    pending_drafts: dict[str, list[int]] = {}
    has_nspec = hasattr(d.SchedulerOutput, "num_spec_tokens_array")
    # arrays path: results as flat arrays (UpdateResult) where the build has them (older
    # builds, e.g. a pinned baseline snapshot, return RequestOutput objects only).
    update_arrays = getattr(sched, "update_from_output_arrays", None)
    flat_update = arrays and update_arrays is not None
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
        if not own_drafts:
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
            if own_drafts:
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
        if flat_update:
            result = update_arrays(so, mro)
            t4 = pc()
            finished_ids = set(result.finished_req_ids)
        else:
            outs = sched.update_from_output(so, mro)
            if read_outputs:
                for o in outs:
                    _id, _tokens, _reason = o.request_id, o.new_token_ids, o.finish_reason
            t4 = pc()
            finished_ids = {o.request_id for o in outs if o.finish_reason is not None}
        if prof is not None:
            prof.disable()

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

    pc = clock(args)
    out = {}
    rng = np.random.default_rng(seed)
    for L in sorted({args.micro_prompt_len, MICRO_SHORT_PROMPT_LEN}):
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
            # Timed exactly as the vLLM side (compare_vllm.py's admit worker): one clock read
            # before Request() and one after add_request(), none in between (a CPU-time clock
            # read costs about 0.6 us here).
            for i, p in enumerate(ps):
                rid = f"m{i}"
                t0 = pc()
                r = Request(rid, p, 16)
                sched.add_request(r)
                times.append(pc() - t0)
            # Request() alone, on the same prompts.
            for i, p in enumerate(ps):
                rid = f"c{i}"
                t0 = pc()
                r = Request(rid, p, 16)
                t_req.append(pc() - t0)
            out[f"admit_{L}_{path}"] = summarize_ns(times)
            out[f"request_ctor_{L}_{path}"] = summarize_ns(t_req)
            del sched
    out["prompt_lens"] = sorted({args.micro_prompt_len, MICRO_SHORT_PROMPT_LEN})
    out["iters"] = iters
    return out
