"""Per-phase CPU time of one decode step through Python: N running DFlash requests, flat arrays.

    .venv/bin/python benches/step_breakdown.py [N] [K] [list|arrays]

A quick probe of where a step's time goes (``schedule``, ``update_from_output``, the draft
update), uniform 0..K acceptance. ``arrays`` applies outputs with
``update_from_output_arrays`` (flat results) instead of one ``RequestOutput`` per request.
The side-by-side benchmark against vLLM is ``benches/compare_vllm.py`` (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import sys
import time
from typing import List, Tuple

import numpy as np

from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig


def build(n: int, k: int, rng: np.random.Generator) -> Scheduler:
    """N decoding requests with 128-1023-token prompts that never finish."""
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=n * 600,
            max_num_seqs=n,
            max_num_batched_tokens=65536,
            max_model_len=8192,
            speculative=SpeculativeConfig("dflash", k),
        )
    )
    for i in range(n):
        prompt = rng.integers(3, 32000, int(rng.integers(128, 1024)), dtype=np.int32)
        sched.add_request(Request(f"r{i}", prompt, 100_000, ignore_eos=True))
    return sched


def step(sched: Scheduler, k: int, rng: np.random.Generator, arrays: bool) -> Tuple[int, int, int]:
    """One engine step; returns the CPU ns of schedule, update_from_output and the drafts."""
    t0 = time.thread_time_ns()
    out = sched.schedule()
    t1 = time.thread_time_ns()
    chunk = np.asarray(out.is_prefill_chunk)
    accepted = rng.integers(0, out.num_spec_tokens_array.astype(np.int64) + 1)
    counts = np.where(chunk, 0, accepted + 1).astype(np.int32)
    tokens = rng.integers(3, 32000, int(counts.sum()), dtype=np.int32)
    runner = ModelRunnerOutput.from_arrays(out.req_ids, tokens, counts)
    t2 = time.thread_time_ns()
    if arrays:
        sched.update_from_output_arrays(out, runner)
    else:
        sched.update_from_output(out, runner)
    t3 = time.thread_time_ns()
    num_drafts = np.where(chunk, 0, k).astype(np.int32)
    drafts = rng.integers(3, 32000, int(num_drafts.sum()), dtype=np.int32)
    t4 = time.thread_time_ns()
    sched.update_draft_token_ids_from_arrays(out, drafts, num_drafts)
    t5 = time.thread_time_ns()
    return t1 - t0, t3 - t2, t5 - t4


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    k = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    arrays = len(sys.argv) > 3 and sys.argv[3] == "arrays"
    rng = np.random.default_rng(0)
    sched = build(n, k, rng)
    for _ in range(30):  # prefill and warm-up
        step(sched, k, rng, arrays)
    samples: List[Tuple[int, int, int]] = [step(sched, k, rng, arrays) for _ in range(150)]
    us = np.array(samples) / 1000
    p50 = np.median(us, axis=0)
    print(
        f"N={n} K={k} {'arrays' if arrays else 'list'}: schedule p50 {p50[0]:.0f} us, "
        f"update_from_output p50 {p50[1]:.0f} us, drafts p50 {p50[2]:.0f} us, "
        f"total p50 {np.median(us.sum(axis=1)):.0f} us (CPU time)"
    )


if __name__ == "__main__":
    main()
