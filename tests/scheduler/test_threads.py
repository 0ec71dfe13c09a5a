"""Several Python threads on one Scheduler: calls are refused with a typed error or succeed,
and no Rust panic reaches Python (the GIL is released inside schedule())."""

from __future__ import annotations

import threading

import numpy as np

from dflash_rs import (
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SchedulerStateError,
    SpeculativeConfig,
)


def test_concurrent_calls_are_refused_cleanly() -> None:
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=20_000,
            max_num_seqs=512,
            max_num_batched_tokens=32_768,
            speculative=SpeculativeConfig("dflash", 8),
        )
    )
    for i in range(512):
        sched.add_request(Request(f"r{i}", np.arange(60, dtype=np.int32) + i, 10_000))
    errors: list = []
    crashes: list = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: crashes.append(args.exc_type)

    def worker() -> None:
        for _ in range(100):
            try:
                out = sched.schedule()
                sampled = [[] if chunk else [1] for chunk in out.is_prefill_chunk]
                sched.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
            except Exception as e:  # PanicException is a BaseException and is not caught here
                errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        threading.excepthook = previous_hook
    assert crashes == [], f"a thread died with {crashes}"
    assert all(isinstance(e, (SchedulerStateError, RuntimeError)) for e in errors), {
        type(e).__name__ for e in errors
    }
    sched.check_invariants()
