"""The workload of the scheduler benchmark: a faithful re-implementation of the prompt
generator of vLLM's scheduler anchor harness (``bench_vllm_scheduler.py``), so that for one seed
both schedulers see identical prompts (checked by sha256 in ``--baseline-python`` runs)."""

from __future__ import annotations

import hashlib
import math

import numpy as np

VOCAB = 32000
FIRST_TOKEN = 3  # sampled/prompt tokens are drawn from [3, VOCAB), as in the harness


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
