"""Test helpers for the DFlash expansion: random cases and an independent plain-Python oracle.

The oracle is written per lane straight from the semantics of vLLM's
``copy_and_expand_dflash_inputs_kernel``, plus
the strict-mode rules and the padding conventions of ``dflash_rs.kernels``. It shares no code with
the package, so a bug has to be made twice to go unnoticed.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from dflash_rs.kernels import DFlashInputs
from dflash_rs.kernels.result import LANE_BUFFERS

OUTPUT_FIELDS = (*LANE_BUFFERS, "num_violations")
SEED_ENV = "DFLASH_KERNEL_TEST_SEED"
POISON = -7777


def poison(out: DFlashInputs) -> DFlashInputs:
    """Set every output lane and every per-program violation slot to POISON.

    ``num_violations`` is a sum computed when read, so poisoning the slots it sums is what makes
    a slot the kernel forgets to write show up as a wrong count.
    """
    for name in OUTPUT_FIELDS:
        if name != "num_violations":
            getattr(out, name).fill_(POISON)
    out.violation_partials.fill_(POISON)
    return out


def fresh_seed() -> int:
    """A new seed per call, unless DFLASH_KERNEL_TEST_SEED pins one to replay a failure."""
    pinned = os.environ.get(SEED_ENV)
    return int(pinned) if pinned else secrets.randbits(63)


@dataclass
class Case:
    """Inputs of one expansion, as numpy arrays (the oracle's view) plus the call's scalars."""

    next_token_ids: np.ndarray
    target_positions: np.ndarray
    query_start_loc: np.ndarray
    block_table: np.ndarray  # may be wider/taller than what the call sees
    table_rows: int
    table_width: int
    num_speculative_tokens: int
    block_size: int
    mask_token_id: int
    num_rejected_tokens: Optional[np.ndarray] = None
    num_blocks_per_row: Optional[np.ndarray] = None
    max_model_len: Optional[int] = None
    extra_reqs: int = 0  # padding capacity of out=
    extra_ctx: int = 0
    seed: int = 0
    notes: dict = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.next_token_ids)

    @property
    def num_ctx(self) -> int:
        return len(self.target_positions)

    def describe(self) -> str:
        return (
            f"seed={self.seed} (replay: {SEED_ENV}={self.seed}) num_reqs={self.num_reqs} "
            f"num_ctx={self.num_ctx} K={self.num_speculative_tokens} block={self.block_size} "
            f"table={self.table_rows}x{self.table_width} rejected="
            f"{self.num_rejected_tokens is not None} strict={self.num_blocks_per_row is not None} "
            f"max_model_len={self.max_model_len} pad=({self.extra_reqs},{self.extra_ctx}) "
            f"{self.notes}"
        )

    def torch_args(self, device: str = "cpu") -> tuple[tuple, dict]:
        """Positional and keyword arguments of expand_dflash_inputs for this case."""

        def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(array, dtype=dtype, device=device)

        parent = tensor(self.block_table, torch.int32)
        table = parent[: self.table_rows, : self.table_width]  # a view: row stride = parent's
        positional = (
            tensor(self.next_token_ids, torch.int32),
            tensor(self.target_positions, torch.int64),
            tensor(self.query_start_loc, torch.int32),
            table,
        )
        keywords: dict = {
            "block_size": self.block_size,
            "num_speculative_tokens": self.num_speculative_tokens,
            "mask_token_id": self.mask_token_id,
        }
        if self.num_rejected_tokens is not None:
            keywords["num_rejected_tokens"] = tensor(self.num_rejected_tokens, torch.int32)
        if self.num_blocks_per_row is not None:
            keywords["num_blocks_per_row"] = tensor(self.num_blocks_per_row, torch.int32)
        if self.max_model_len is not None:
            keywords["max_model_len"] = self.max_model_len
        return positional, keywords

    def poisoned_out(self, device: str = "cpu") -> DFlashInputs:
        """Output buffers with padding capacity, every lane set to POISON."""
        out = DFlashInputs.empty(
            self.num_reqs + self.extra_reqs,
            self.num_ctx + self.extra_ctx,
            self.num_speculative_tokens,
            device,
        )
        return poison(out)


def oracle(case: Case) -> dict[str, list[int]]:
    """Expected outputs (with padding lanes), derived lane by lane from the pseudo-code."""
    num_spec = case.num_speculative_tokens
    num_query = num_spec + 1
    block_size = case.block_size
    width = case.table_width
    table = case.block_table
    positions_in = [int(p) for p in case.target_positions]
    qsl = [int(x) for x in case.query_start_loc]
    strict = case.num_blocks_per_row is not None
    cap_reqs = case.num_reqs + case.extra_reqs
    cap_ctx = case.num_ctx + case.extra_ctx

    input_ids = [0] * (cap_reqs * num_query)
    query_positions = [0] * (cap_reqs * num_query)
    query_slots = [-1] * (cap_reqs * num_query)
    context_positions = [0] * cap_ctx
    context_slots = [-1] * cap_ctx
    token_indices = [0] * (cap_reqs * num_spec)
    violations = 0

    def slot_of(r: int, pos: int) -> int:
        nonlocal violations
        if not strict:
            col = min(pos // block_size, width - 1)  # the silent clamp
            return int(table[r, col]) * block_size + pos % block_size
        col = pos // block_size
        ok = col < int(case.num_blocks_per_row[r]) and col < width
        ok = ok and (case.max_model_len is None or pos < case.max_model_len)
        ok = ok and int(table[r, col]) != 0
        if not ok:
            violations += 1
            return -1
        return int(table[r, col]) * block_size + pos % block_size

    for r in range(case.num_reqs):
        cs, ce = qsl[r], qsl[r + 1]
        n_ctx = ce - cs
        rejected = int(case.num_rejected_tokens[r]) if case.num_rejected_tokens is not None else 0
        vce = ce - rejected
        last = positions_in[vce - 1]
        for j in range(n_ctx + num_query):
            if j < n_ctx:
                pos = positions_in[cs + j]
                context_positions[cs + j] = pos
                context_slots[cs + j] = slot_of(r, pos)
            else:
                q = j - n_ctx
                pos = last + 1 + q
                qi = r * num_query + q
                query_positions[qi] = pos
                query_slots[qi] = slot_of(r, pos)
                input_ids[qi] = int(case.next_token_ids[r]) if q == 0 else case.mask_token_id
    # Context positions are copied for every lane of the batch; padding lanes stay 0.
    for i, pos in enumerate(positions_in):
        context_positions[i] = pos
    # Sample indices are structural over the whole capacity, padding requests included.
    for r in range(cap_reqs):
        for q in range(1, num_query):
            token_indices[r * num_spec + q - 1] = r * num_query + q
    return {
        "input_ids": input_ids,
        "query_positions": query_positions,
        "query_slot_mapping": query_slots,
        "context_positions": context_positions,
        "context_slot_mapping": context_slots,
        "token_indices_to_sample": token_indices,
        "num_violations": [violations],
    }


def _split(rng: np.random.Generator, total: int, parts: int, shape: str) -> np.ndarray:
    """``parts`` positive lengths summing to ``total``."""
    if shape == "uniform" and total % parts == 0:
        return np.full(parts, total // parts)
    if shape == "one_long" and parts > 1 and total > 2 * parts:
        lengths = 1 + (rng.random(parts) < 0.3) * rng.integers(0, 9, parts)
        lengths = np.minimum(lengths, (total - 1) // parts)
        lengths[rng.integers(parts)] += total - lengths.sum()
        return lengths
    cuts = np.sort(rng.choice(total - 1, parts - 1, replace=False) + 1) if parts > 1 else []
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(np.int64)


def random_case(
    rng: np.random.Generator,
    seed: int,
    *,
    num_reqs: int,
    num_ctx: int,
    num_spec: int,
    block_size: int,
    rejected: bool,
    strict: bool = False,
    lengths: str = "random",
    clamp: bool = False,
    padding: bool = True,
    context_lens: Optional[list[int]] = None,
) -> Case:
    """A random batch; ``clamp`` makes the table narrower than some positions need.

    ``context_lens`` (positive) fixes every request's context length, and with it num_reqs and
    num_ctx (the two arguments are then ignored).
    """
    if context_lens is not None:
        lens = np.asarray(context_lens, dtype=np.int64)
        num_reqs, num_ctx = len(lens), int(lens.sum())
        lengths = "given"
    else:
        num_ctx = max(num_ctx, num_reqs)
        lens = _split(rng, num_ctx, num_reqs, lengths)
    starts = rng.integers(0, 40 * block_size + 1, num_reqs)
    scrambled = rng.random() < 0.15  # positions need not be contiguous: they are copied
    pieces = []
    for start, length in zip(starts, lens):
        run = np.arange(start, start + length)
        pieces.append(rng.permutation(run) if scrambled else run)
    positions = np.concatenate(pieces).astype(np.int64)
    needed = (int(positions.max()) + num_spec + 2) // block_size + 1
    width = int(rng.integers(1, max(2, needed // 2))) if clamp else needed + int(rng.integers(0, 3))
    extra_rows, extra_cols = int(rng.integers(0, 3)), int(rng.integers(0, 3))
    table = rng.integers(0, 5000, (num_reqs + extra_rows, width + extra_cols)).astype(np.int32)
    table[rng.random(table.shape) < 0.05] = 0  # some null-block entries
    case = Case(
        next_token_ids=rng.integers(0, 150_000, num_reqs).astype(np.int32),
        target_positions=positions,
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
        block_table=table,
        table_rows=num_reqs + int(rng.integers(0, extra_rows + 1)),
        table_width=width,
        num_speculative_tokens=num_spec,
        block_size=block_size,
        mask_token_id=int(rng.integers(150_000, 160_000)),
        seed=seed,
        notes={"lengths": lengths, "clamp": clamp, "scrambled": scrambled},
    )
    if rejected:
        case.num_rejected_tokens = np.minimum(
            rng.integers(0, num_spec + 1, num_reqs), lens - 1
        ).astype(np.int32)
    if strict:
        case.num_blocks_per_row = rng.integers(0, width + 1, num_reqs + 2).astype(np.int32)
        if rng.random() < 0.5:
            case.max_model_len = int(rng.integers(1, int(positions.max()) + num_spec + 3))
    if padding:
        case.extra_reqs, case.extra_ctx = int(rng.integers(0, 4)), int(rng.integers(0, 40))
    return case


def assert_matches(result: DFlashInputs, expected: dict[str, list[int]], case: Case, who: str):
    """Compare every output field, naming the first differing lane and the seed."""
    for name in OUTPUT_FIELDS:
        got = getattr(result, name).cpu().tolist()
        want = expected[name]
        if got != want:
            if len(got) != len(want):
                detail = f"length {len(got)} != {len(want)}"
            else:
                lane = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
                detail = f"lane {lane}: got {got[lane]}, expected {want[lane]}"
            raise AssertionError(f"{who}: {name} differs ({detail}); {case.describe()}")
