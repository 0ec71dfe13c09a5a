#!/usr/bin/env python3
"""Per-step CPU cost of dflash-rs's Scheduler, driven through Python like an engine.

A thin wrapper of ``dflash-rs bench`` (the logic lives in ``python/dflash_rs/bench``); same
flags. Example:

  .venv/bin/python benches/scheduler_bench.py --n-reqs 64,256,1024 --spec dflash \
      --modes decode,serve,preempt,micro --reps 3 --json bench_sched.json
"""

from __future__ import annotations

import sys

from dflash_rs.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
