"""Reads KV back through block tables every step and checks that every value is the reader's own.

Checked every step (strict, O(live context tokens) per step):

* Read-back, target channel: every scheduled request reads its whole context, positions
  ``0 .. num_computed + num_scheduled - 1``, through its block-table row; each value must be
  the content tag of its own tokens (shared prefix blocks carry identical content tags).
* Read-back, drafter channel (methods with a drafter): every scheduled request's valid drafter
  context ``0 .. last`` must hold content tags, and every query lane written this step must read
  back the tag the request wrote (query tags are private to request, position and step).
* Read-back of requests that hold blocks but were not scheduled this step: positions
  ``0 .. num_computed - 1`` through ``block_ids()``, in both channels, so a stray write into an
  idle request's blocks is caught in the step it happens.
* Foreign writes: every target, drafter-context and drafter-query lane must land in a block the
  writer owns (``Scheduler.block_ids``), at the column and offset of its position.
* Block table: each row's first ``num_blocks_per_row`` entries equal ``block_ids()``.
* DFlash kernel: default and strict runs agree on positions, input ids, sample indices and on
  every slot strict mode did not pad; strict mode's counter equals its padded lanes.

``integrity_violations`` = read-back mismatches + foreign writes. Ownership violations (strict
kernel) are counted by the model and kept apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from dflash_rs.sim.batch import StepBatch
from dflash_rs.sim.kv_store import DRAFTER, TARGET, PagedKVStore
from dflash_rs.sim.ledger import Ledger, TrackedRequest
from dflash_rs.sim.model import DrafterPass, WriteLanes
from dflash_rs.sim.tags import EMPTY, is_query_tag
from dflash_rs.sim.workload import MASK_TOKEN_ID

__all__ = ["Verifier", "Violation"]

_CHANNEL_NAMES = {TARGET: "target", DRAFTER: "drafter"}


@dataclass(frozen=True)
class Violation:
    """One failed check, with what was expected and what was found."""

    step: int
    kind: str
    request_id: str
    position: int
    slot: int
    detail: str

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        where = f"position {self.position}" + (f", slot {self.slot}" if self.slot >= 0 else "")
        return f"step {self.step}: {self.kind}: {self.request_id} {where}: {self.detail}"


def _segments(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(segment index, offset within segment) of every element of consecutive segments."""
    seg = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    return seg, np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)


def _pad(lists: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged block lists as a 2-D int64 array padded with -1 (at least one column)."""
    width = max([len(b) for b in lists] + [1])
    out = np.full((len(lists), width), -1, np.int64)
    for i, blocks in enumerate(lists):
        out[i, : len(blocks)] = blocks
    return out


class Verifier:
    def __init__(
        self, store: PagedKVStore, ledger: Ledger, block_size: int, max_records: int = 25
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.block_size = block_size
        self.max_records = max_records
        self.counts: Dict[str, int] = {
            "readback_target": 0,
            "readback_drafter": 0,
            "readback_query": 0,
            "foreign_writes": 0,
            "table_mismatches": 0,
            "kernel_mismatches": 0,
        }
        self.slots_checked = 0
        self.records: List[Violation] = []
        self._step_total = 0

    # -- results --------------------------------------------------------------------------

    @property
    def readback_mismatches(self) -> int:
        c = self.counts
        return c["readback_target"] + c["readback_drafter"] + c["readback_query"]

    @property
    def integrity_violations(self) -> int:
        return self.readback_mismatches + self.counts["foreign_writes"]

    @property
    def total(self) -> int:
        """Every failed check of any kind."""
        return sum(self.counts.values())

    def _record(self, count_key: str, violations: List[Violation], count: int) -> None:
        self.counts[count_key] += count
        room = self.max_records - len(self.records)
        self.records.extend(violations[: max(room, 0)])

    def _describe(self, channel: int, slot: int, expected: int, found: int) -> str:
        if found == EMPTY:
            what = "a slot never written"
        else:
            writer, position = self.store.provenance(channel, slot)
            kind = "query" if is_query_tag(np.array([found]))[0] else "content"
            who = self.ledger.by_index(writer).request_id if writer >= 0 else "nobody known"
            what = f"a {kind} value written by {who} at position {position}"
        block, offset = divmod(slot, self.block_size)
        return (
            f"{_CHANNEL_NAMES[channel]} channel, block {block} offset {offset}: expected "
            f"{expected:#x}, found {what}"
        )

    # -- the step ---------------------------------------------------------------------------

    def check_step(
        self,
        batch: StepBatch,
        owned: List[List[int]],
        target: WriteLanes,
        drafter: Optional[DrafterPass],
        idle: Sequence[TrackedRequest],
        idle_owned: List[List[int]],
        idle_computed: Sequence[int],
    ) -> int:
        """Run every check of one step; returns the step's number of failed checks."""
        before = self.total
        owned_table = _pad(owned)
        self._check_table(batch, owned, owned_table)
        self._check_foreign(batch, owned_table, target)
        self._check_context(batch, TARGET, batch.end)
        if drafter is not None:
            self._check_foreign(batch, owned_table, drafter.context)
            self._check_foreign(batch, owned_table, drafter.queries)
            self._check_context(batch, DRAFTER, drafter.valid_end)
            self._check_queries(batch, drafter.queries)
            if drafter.kernel is not None:
                self._check_kernel(batch, drafter)
        if idle:
            channels = (TARGET, DRAFTER) if drafter is not None else (TARGET,)
            self._check_idle(batch.step, idle, idle_owned, idle_computed, channels)
        return self.total - before

    def _check_table(
        self, batch: StepBatch, owned: List[List[int]], owned_table: np.ndarray
    ) -> None:
        width = min(owned_table.shape[1], batch.table.shape[1])
        counts = np.array([len(b) for b in owned], np.int64)
        cols = np.arange(width)
        live = cols[None, :] < counts[:, None]
        differ = live & (batch.table[:, :width] != owned_table[:, :width])
        bad_rows = np.flatnonzero(differ.any(axis=1) | (batch.blocks_per_row != counts))
        records = [
            Violation(
                batch.step,
                "block-table",
                batch.req_ids[i],
                -1,
                -1,
                f"row holds {batch.table[i, : batch.blocks_per_row[i]].tolist()} "
                f"(count {batch.blocks_per_row[i]}), block_ids() is {owned[i]}",
            )
            for i in bad_rows[:5]
        ]
        self._record("table_mismatches", records, len(bad_rows))

    def _check_foreign(self, batch: StepBatch, owned_table: np.ndarray, lanes: WriteLanes) -> None:
        written = lanes.slots >= 0
        rows, positions, slots = lanes.rows[written], lanes.positions[written], lanes.slots[written]
        bs = self.block_size
        cols = positions // bs
        in_row = cols < owned_table.shape[1]
        block = owned_table[rows, np.minimum(cols, owned_table.shape[1] - 1)]
        ok = in_row & (block >= 0) & (block == slots // bs) & (slots % bs == positions % bs)
        bad = np.flatnonzero(~ok)
        records = []
        for j in bad[:5]:
            b, offset = divmod(int(slots[j]), bs)
            owner = self._block_owner_note(owned_table, batch, b)
            records.append(
                Violation(
                    batch.step,
                    f"foreign-write ({lanes.kind})",
                    batch.req_ids[rows[j]],
                    int(positions[j]),
                    int(slots[j]),
                    f"wrote block {b} offset {offset} (column {int(cols[j])}); it owns "
                    f"{[int(x) for x in owned_table[rows[j]] if x >= 0]}{owner}",
                )
            )
        self._record("foreign_writes", records, len(bad))

    @staticmethod
    def _block_owner_note(owned_table: np.ndarray, batch: StepBatch, block: int) -> str:
        if block == 0:
            return "; block 0 is the null block, shared by every unallocated column"
        holders = [batch.req_ids[i] for i in np.flatnonzero((owned_table == block).any(axis=1))]
        return f"; block {block} belongs to {holders}" if holders else ""

    def _readback(
        self,
        step: int,
        kind: str,
        channel: int,
        request_ids: Sequence[str],
        tables: np.ndarray,
        ends: np.ndarray,
        expected: np.ndarray,
    ) -> None:
        """Read positions ``0 .. ends[i] - 1`` of row ``i`` through ``tables[i]``."""
        rows, positions = _segments(ends)
        bs = self.block_size
        cols = positions // bs
        width = tables.shape[1]
        blocks = np.where(
            cols < width, tables[rows, np.minimum(cols, width - 1)].astype(np.int64), -1
        )
        slots = blocks * bs + positions % bs
        valid = blocks > 0
        found = np.full(len(slots), EMPTY, np.int64)
        found[valid] = self.store.read(channel, np.ascontiguousarray(slots[valid]))
        self.slots_checked += len(slots)
        bad = np.flatnonzero(found != expected)
        records = [
            Violation(
                step,
                f"readback ({kind})",
                request_ids[rows[j]],
                int(positions[j]),
                int(slots[j]),
                self._describe(channel, int(slots[j]), int(expected[j]), int(found[j])),
            )
            for j in bad[:5]
        ]
        self._record(f"readback_{_CHANNEL_NAMES[channel]}", records, len(bad))

    def _check_context(self, batch: StepBatch, channel: int, ends: np.ndarray) -> None:
        expected = np.concatenate([tags[: int(end)] for tags, end in zip(batch.context_tags, ends)])
        kind = f"{_CHANNEL_NAMES[channel]} context"
        self._readback(batch.step, kind, channel, batch.req_ids, batch.table, ends, expected)

    def _check_idle(
        self,
        step: int,
        idle: Sequence[TrackedRequest],
        owned: List[List[int]],
        computed: Sequence[int],
        channels: Sequence[int],
    ) -> None:
        ends = np.array(computed, np.int64)
        tables = _pad(owned)
        expected = np.concatenate([r.tags[: int(e)] for r, e in zip(idle, ends)])
        ids = [r.request_id for r in idle]
        for channel in channels:
            kind = f"{_CHANNEL_NAMES[channel]} context, not scheduled"
            self._readback(step, kind, channel, ids, tables, ends, expected)

    def _check_queries(self, batch: StepBatch, queries: WriteLanes) -> None:
        written = queries.slots >= 0
        slots = queries.slots[written]
        found = self.store.read(DRAFTER, np.ascontiguousarray(slots))
        expected = queries.values[written]
        self.slots_checked += len(slots)
        bad = np.flatnonzero(found != expected)
        rows, positions = queries.rows[written], queries.positions[written]
        records = [
            Violation(
                batch.step,
                "readback (drafter query)",
                batch.req_ids[rows[j]],
                int(positions[j]),
                int(slots[j]),
                self._describe(DRAFTER, int(slots[j]), int(expected[j]), int(found[j])),
            )
            for j in bad[:5]
        ]
        self._record("readback_query", records, len(bad))

    def _check_kernel(self, batch: StepBatch, drafter: DrafterPass) -> None:
        record = drafter.kernel
        assert record is not None
        d, s = record.default, record.strict
        n = batch.num_reqs
        num_query = len(d["query_positions"]) // max(n, 1)
        q = np.tile(np.arange(num_query, dtype=np.int64), n)
        last = np.repeat(drafter.valid_end - 1, num_query)
        samples = np.arange(n * num_query, dtype=np.int64).reshape(n, num_query)[:, 1:].ravel()
        problems: Dict[str, int] = {}

        def expect(name: str, bad: np.ndarray) -> None:
            if bad.any():
                problems[name] = int(bad.sum())

        for mode, out in (("default", d), ("strict", s)):
            expect(f"{mode} context positions", out["context_positions"] != batch.positions)
            expect(f"{mode} query positions", out["query_positions"] != last + 1 + q)
            ids = out["input_ids"].reshape(n, num_query)
            expect(f"{mode} bonus input ids", ids[:, 0] != record.anchor_tokens)
            expect(f"{mode} mask input ids", ids[:, 1:] != MASK_TOKEN_ID)
            expect(f"{mode} sample indices", out["token_indices_to_sample"] != samples)
        for lanes in ("context_slot_mapping", "query_slot_mapping"):
            kept = s[lanes] >= 0
            expect(f"strict {lanes} differs from default", s[lanes][kept] != d[lanes][kept])
        padded = int((s["context_slot_mapping"] < 0).sum() + (s["query_slot_mapping"] < 0).sum())
        if padded != record.strict_counter:
            problems[f"strict counter {record.strict_counter} != {padded} padded lanes"] = 1
        if problems:
            detail = "; ".join(f"{name}: {count}" for name, count in problems.items())
            violation = Violation(batch.step, "dflash-kernel", "*", -1, -1, detail)
            self._record("kernel_mismatches", [violation], sum(problems.values()))
