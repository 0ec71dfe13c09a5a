"""A step never faults in a fresh huge page.

The extension's allocator backs its memory with transparent huge pages where the OS allows
them on request (THP mode ``madvise``). Each first touch of such a page zeroes 2 MiB inside the
call that made it: a stall of up to several milliseconds in one engine step. The scheduler
touches a warm reserve when it is built and never returns freed memory to the OS, so its steps
find their pages already faulted in. Measured in a fresh process: the process's huge-page-backed
memory (``AnonHugePages``) must not grow while the steps run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def thp_mode() -> str:
    try:
        with open(THP_MODE) as f:
            modes = f.read().split()
    except OSError:
        return "unavailable"
    return next((m.strip("[]") for m in modes if m.startswith("[")), "unknown")


STEPS = textwrap.dedent(
    """
    from dflash_rs import ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SpeculativeConfig

    def anon_huge_kib():
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
        raise SystemExit("no AnonHugePages in smaps_rollup")

    n = 256
    config = SchedulerConfig(
        20000, block_size=16, max_num_seqs=n, max_num_batched_tokens=1 << 16,
        max_model_len=4096, speculative=SpeculativeConfig("dflash", 8),
    )
    s = Scheduler(config)
    for i in range(n):
        s.add_request(Request(str(i), [(i * 7 + j) % 30000 + 1 for j in range(512)], 300))
    before = anon_huge_kib()
    steps = 0
    while s.has_unfinished_requests():
        out = s.schedule()
        sampled = [[(steps * 13 + k) % 30000 + 1] for k in range(len(out.req_ids))]
        s.update_from_output(out, ModelRunnerOutput(out.req_ids, sampled))
        steps += 1
    print(before, anon_huge_kib(), steps)
    """
)


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() != "madvise",
    reason="needs Linux with transparent huge pages on request (madvise): "
    "elsewhere no allocation of the extension is backed by huge pages",
)
def test_steps_fault_in_no_huge_page() -> None:
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(
        [sys.executable, "-c", STEPS], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr
    before, after, steps = map(int, done.stdout.split())
    assert steps > 300, "every request ran to its 300 tokens"
    assert after == before, (
        f"the steps faulted in {(after - before) // 2048} huge page(s) "
        f"({before} KiB of huge pages before the first step, {after} KiB after)"
    )
