"""The glue from a SchedulerOutput to the kernel's inputs, and the incremental device table.

Hand computations of positions and ``query_start_loc``; zero-copy sharing of the scheduler's
read-only block table on CPU; ``DeviceBlockTable`` copying only the rows that changed (on CPU
with a fake device: a separate CPU tensor), and on a GPU with pinned, non-blocking copies.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch

from dflash_rs import (
    InvalidArgumentError,
    ModelRunnerOutput,
    Request,
    Scheduler,
    SchedulerConfig,
    SpeculativeConfig,
)
from dflash_rs.kernels import (
    DeviceBlockTable,
    context_positions,
    expand_dflash_inputs,
    expand_from_output,
    kernel_inputs_from_output,
    shared_tensor,
)

BLOCK = 16
MASK = 3
WIDTH = 8


def make_scheduler(k: int = 3, **kwargs) -> Scheduler:
    settings = dict(num_blocks=256, block_size=BLOCK, max_model_len=WIDTH * BLOCK, max_num_seqs=8)
    settings.update(kwargs)
    return Scheduler(SchedulerConfig(speculative=SpeculativeConfig("dflash", k), **settings))


def feed(sched: Scheduler, out, sampled, drafts=None) -> None:
    sched.update_from_output(out, ModelRunnerOutput(list(out.req_ids), sampled))
    if drafts:
        sched.update_draft_token_ids(drafts)


# ---------------------------------------------------------------------------------------------
# positions, query_start_loc, per-request inputs


def test_context_positions_by_hand():
    got = context_positions(np.array([0, 20, 5, 7]), np.array([3, 4, 0, 1]))
    assert got.dtype == np.int64
    assert got.tolist() == [0, 1, 2, 20, 21, 22, 23, 7]
    assert context_positions(np.array([], np.int32), np.array([], np.int32)).tolist() == []
    with pytest.raises(InvalidArgumentError):
        context_positions(np.array([1, 2]), np.array([1]))
    with pytest.raises(InvalidArgumentError):
        context_positions(np.array([1]), np.array([-1]))


def test_prefill_decode_and_chunk_inputs_by_hand():
    """Step 0: a full prefill (a, 20 tokens) and a chunk (b, 30 tokens, budget 24 - 20 = 4).
    Step 1: a decodes with 3 drafts, b continues its prompt."""
    sched = make_scheduler(3, max_num_batched_tokens=24)
    sched.add_request(Request("a", list(range(100, 120)), 8))
    sched.add_request(Request("b", list(range(200, 230)), 8))
    out = sched.schedule()
    assert list(out.req_ids) == ["a", "b"]
    inputs = kernel_inputs_from_output(out, next_token_ids=np.array([7, 204], dtype=np.int64))
    assert inputs.target_positions.dtype == torch.int64
    assert inputs.target_positions.tolist() == [*range(20), *range(4)]
    assert inputs.query_start_loc.dtype == torch.int32
    assert inputs.query_start_loc.tolist() == [0, 20, 24]
    assert inputs.next_token_ids.dtype == torch.int32
    assert inputs.next_token_ids.tolist() == [7, 204]
    assert inputs.num_rejected_tokens is None
    assert inputs.num_blocks_per_row.tolist() == [2, 1]  # cdiv(20 + 4, 16), cdiv(4 + 4, 16)
    assert inputs.block_table[0, :2].tolist() == sched.block_ids("a")
    assert (inputs.num_reqs, inputs.num_ctx, inputs.device.type) == (2, 24, "cpu")

    feed(sched, out, [[7], []], {"a": [1, 2, 3]})
    out = sched.schedule()
    assert list(out.req_ids) == ["a", "b"]
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}
    inputs = kernel_inputs_from_output(
        out, next_token_ids=[9, 220], num_rejected_tokens=torch.tensor([2, 0])
    )
    # a: the last token (position 20) plus 3 drafts; b: prompt positions 4..23 (budget 20).
    assert inputs.target_positions.tolist() == [20, 21, 22, 23, *range(4, 24)]
    assert inputs.query_start_loc.tolist() == [0, 4, 24]
    assert inputs.num_rejected_tokens is not None
    assert inputs.num_rejected_tokens.dtype == torch.int32
    assert inputs.num_rejected_tokens.tolist() == [2, 0]

    result = expand_from_output(
        out,
        sched.config,
        next_token_ids=[9, 220],
        num_rejected_tokens=[2, 0],
        mask_token_id=MASK,
        strict=True,
        backend="reference",
    )
    # a: valid context ends at 21 (2 of 3 drafts rejected) -> queries 22..25; b: 24..27.
    assert result.query_positions.tolist() == [22, 23, 24, 25, 24, 25, 26, 27]
    assert result.input_ids.tolist() == [9, MASK, MASK, MASK, 220, MASK, MASK, MASK]
    assert result.num_violations.tolist() == [0]


def test_bad_per_request_inputs_are_rejected():
    sched = make_scheduler()
    sched.add_request(Request("a", [5] * 10, 4))
    out = sched.schedule()
    with pytest.raises(InvalidArgumentError, match="one entry per scheduled request"):
        kernel_inputs_from_output(out, next_token_ids=[1, 2])
    with pytest.raises(InvalidArgumentError, match="integers"):
        kernel_inputs_from_output(out, next_token_ids=np.array([1.5]))
    with pytest.raises(InvalidArgumentError, match="integers"):
        kernel_inputs_from_output(out, next_token_ids=torch.tensor([1.0]))
    with pytest.raises(InvalidArgumentError, match="num_rejected_tokens"):
        kernel_inputs_from_output(out, next_token_ids=[1], num_rejected_tokens=[0, 0])
    with pytest.raises(InvalidArgumentError, match="block_size"):
        expand_from_output(out, next_token_ids=[1], mask_token_id=MASK)
    other = DeviceBlockTable(8, WIDTH, "cpu", mirror=True)
    with pytest.raises(InvalidArgumentError, match="lives on"):
        kernel_inputs_from_output(out, next_token_ids=[1], block_table=other, device="meta")


# ---------------------------------------------------------------------------------------------
# zero copy on CPU


def test_block_table_tensor_shares_the_schedulers_memory():
    sched = make_scheduler()
    for i, n in enumerate((5, 17, 40)):
        sched.add_request(Request(f"r{i}", [10 + i] * n, 4))
    out = sched.schedule()
    view, counts = out.block_table, out.num_blocks_per_row
    assert not view.flags.writeable and not counts.flags.writeable
    inputs = kernel_inputs_from_output(out, next_token_ids=[1, 2, 3])
    assert inputs.block_table.data_ptr() == view.ctypes.data
    assert inputs.num_blocks_per_row.data_ptr() == counts.ctypes.data
    assert inputs.block_table.shape == view.shape and inputs.block_table.dtype == torch.int32
    assert inputs.query_start_loc.data_ptr() == out.query_start_loc.ctypes.data
    # Read-only stays read-only, and the kernel never writes through the shared tensor.
    snapshot = view.copy()
    for strict in (False, True):
        expand_dflash_inputs(
            inputs.next_token_ids,
            inputs.target_positions,
            inputs.query_start_loc,
            inputs.block_table,
            block_size=BLOCK,
            num_speculative_tokens=3,
            mask_token_id=MASK,
            num_blocks_per_row=inputs.num_blocks_per_row if strict else None,
            backend="reference",
        )
    assert not view.flags.writeable
    assert np.array_equal(view, snapshot)
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1


def test_shared_tensor_keeps_writable_arrays_and_raises_no_warning():
    writable = np.arange(6, dtype=np.int32)
    tensor = shared_tensor(writable)
    assert tensor.data_ptr() == writable.ctypes.data
    frozen = np.arange(6, dtype=np.int32)
    frozen.setflags(write=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shared_tensor(frozen).data_ptr() == frozen.ctypes.data
    # The suppression is scoped: the global filters are as they were.
    assert not any("not writable" in str(f[1]) for f in warnings.filters if f[1] is not None)


def test_first_from_numpy_of_a_read_only_view_warns_nothing_in_a_fresh_process():
    """torch warns once per process about non-writable arrays, so only a fresh interpreter
    (with warnings as errors) shows that the glue's first conversion is clean."""
    code = textwrap.dedent(
        """
        import numpy as np
        from dflash_rs import Request, Scheduler, SchedulerConfig, SpeculativeConfig
        from dflash_rs.kernels import kernel_inputs_from_output
        sched = Scheduler(
            SchedulerConfig(64, max_model_len=256, speculative=SpeculativeConfig("dflash", 3))
        )
        sched.add_request(Request("a", [5] * 20, 4))
        out = sched.schedule()
        assert not out.block_table.flags.writeable
        inputs = kernel_inputs_from_output(out, next_token_ids=[1])
        assert inputs.block_table.data_ptr() == out.block_table.ctypes.data
        print("ok")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# ---------------------------------------------------------------------------------------------
# DeviceBlockTable: the copy logic, on CPU with a fake device


def _table(rows: list[list[int]], width: int = WIDTH) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((len(rows), width), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    counts = np.array([len(r) for r in rows], dtype=np.int32)
    table.setflags(write=False)
    counts.setflags(write=False)
    return table, counts


def test_cpu_default_is_a_zero_copy_view():
    dbt = DeviceBlockTable(4, WIDTH)
    assert not dbt.mirror
    table, counts = _table([[1, 2], [3]])
    dev, dev_counts = dbt.update_from_arrays(table, counts)
    assert dev.data_ptr() == table.ctypes.data
    assert dev_counts.data_ptr() == counts.ctypes.data
    assert dbt.last_copy.rows == 0 and dbt.last_copy.bytes == 0


def test_fake_device_copies_only_changed_rows():
    dbt = DeviceBlockTable(6, WIDTH, "cpu", mirror=True, max_ranges=2)
    row_bytes = WIDTH * 4
    table, counts = _table([[1, 2], [3], [4, 5, 6]])
    dev, dev_counts = dbt.update_from_arrays(table, counts)
    assert dev.data_ptr() != table.ctypes.data  # a separate "device" tensor
    assert np.array_equal(dev.numpy(), table) and dev_counts.tolist() == [2, 1, 3]
    assert (dbt.last_copy.rows, dbt.last_copy.copies) == (3, 1)
    assert dbt.last_copy.table_bytes == 3 * row_bytes
    assert dbt.last_copy.counts_bytes == 3 * 4

    # Poison the device copy of rows 0 and 2: an update that leaves them alone keeps the poison.
    dbt.table[0, 7] = -5
    dbt.table[2, 7] = -5
    table, counts = _table([[1, 2], [3, 9], [4, 5, 6]])  # row 1 grew a block
    dev, dev_counts = dbt.update_from_arrays(table, counts)
    assert (dbt.last_copy.rows, dbt.last_copy.copies) == (1, 1)
    assert dbt.last_copy.table_bytes == row_bytes
    assert dev[1].tolist() == table[1].tolist() and dev_counts.tolist() == [2, 2, 3]
    assert dev[0, 7] == -5 and dev[2, 7] == -5  # not copied
    dbt.table[0, 7] = dbt.table[2, 7] = 0

    # Unchanged step: nothing but the counts is sent.
    dbt.update_from_arrays(table, counts)
    assert (dbt.last_copy.rows, dbt.last_copy.copies, dbt.last_copy.table_bytes) == (0, 0, 0)

    # Rows swapped (a request left, the last row moved): same counts, different content.
    table, counts = _table([[1, 2], [4, 5, 6], [3, 9]])
    dev, _ = dbt.update_from_arrays(table, counts)
    assert (dbt.last_copy.rows, dbt.last_copy.copies) == (2, 1)
    assert np.array_equal(dev.numpy(), table)

    # Fewer rows, then more again: rows past num_reqs are compared with the mirror on return.
    table, counts = _table([[1, 2]])
    dev, _ = dbt.update_from_arrays(table, counts)
    assert dev.shape == (1, WIDTH) and dbt.last_copy.rows == 0
    table, counts = _table([[1, 2], [4, 5, 6], [7], [8]])
    dev, dev_counts = dbt.update_from_arrays(table, counts)
    assert dbt.last_copy.rows == 2  # rows 2 and 3; row 1 still holds [4, 5, 6]
    assert np.array_equal(dev.numpy(), table) and dev_counts.tolist() == [2, 3, 1, 1]
    assert dbt.total_rows_copied == 3 + 1 + 2 + 2
    assert dbt.num_updates == 6


def test_fake_device_gathers_scattered_rows():
    """More runs of changed rows than max_ranges: one gathered copy plus an index_copy_."""
    dbt = DeviceBlockTable(8, WIDTH, "cpu", mirror=True, max_ranges=2)
    rows = [[i + 1] for i in range(8)]
    dbt.update_from_arrays(*_table(rows))
    for i in (0, 2, 5, 7):  # four runs of one row
        rows[i] = [*rows[i], 50 + i]
    table, counts = _table(rows)
    dev, dev_counts = dbt.update_from_arrays(table, counts)
    assert (dbt.last_copy.rows, dbt.last_copy.copies) == (4, 1)
    assert dbt.last_copy.table_bytes == 4 * WIDTH * 4 + 4 * 8  # rows plus int64 row indices
    assert np.array_equal(dev.numpy(), table)
    assert dev_counts.tolist() == counts.tolist()
    # Up to max_ranges runs: one copy per run.
    rows[3] = [*rows[3], 99]
    rows[4] = [*rows[4], 98]
    rows[6] = [*rows[6], 97]
    dev, _ = dbt.update_from_arrays(*_table(rows))
    assert (dbt.last_copy.rows, dbt.last_copy.copies) == (3, 2)  # runs [3, 5) and [6, 7)
    assert np.array_equal(dev.numpy(), _table(rows)[0])


def test_device_block_table_rejects_bad_arrays():
    dbt = DeviceBlockTable(2, WIDTH, "cpu", mirror=True)
    with pytest.raises(InvalidArgumentError):
        dbt.update_from_arrays(*_table([[1]], width=WIDTH + 1))
    with pytest.raises(InvalidArgumentError):
        dbt.update_from_arrays(*_table([[1], [2], [3]]))
    with pytest.raises(InvalidArgumentError):
        dbt.update_from_arrays(np.zeros((1, WIDTH), np.int64), np.zeros(1, np.int32))
    with pytest.raises(InvalidArgumentError):
        dbt.update_from_arrays(np.zeros((1, WIDTH), np.int32), np.zeros(2, np.int32))
    with pytest.raises(InvalidArgumentError):
        DeviceBlockTable(0, WIDTH)


def _serve(sched: Scheduler, dbt: DeviceBlockTable, rng: np.random.Generator, steps: int):
    """Run a serving loop; every step the device table must equal the scheduler's view and the
    rows copied must be exactly the rows whose content differs from what the device holds
    (computed here from this test's own mirror). Returns (rows copied, num_reqs) per step."""
    k = sched.config.num_speculative_tokens
    mirror = np.zeros((dbt.max_num_reqs, dbt.width), np.int32)
    log = []
    for step in range(steps):
        if step % 3 == 0:
            tokens = rng.integers(10, 900, 5 + 3 * step).tolist()
            sched.add_request(Request(f"s{step}", tokens, 12))
        out = sched.schedule()
        n = out.num_reqs
        dev, dev_counts = dbt.update(out)
        view = out.block_table
        assert np.array_equal(dev.cpu().numpy(), view)
        assert dev_counts.cpu().tolist() == out.num_blocks_per_row.tolist()
        changed = (mirror[:n] != view).any(axis=1)
        assert dbt.last_copy.rows == int(changed.sum())
        mirror[:n] = view
        log.append((dbt.last_copy.rows, n))

        req_ids = list(out.req_ids)
        chunk = out.is_prefill_chunk
        drafts = out.scheduled_spec_decode_tokens
        sampled = [[] if chunk[i] else [*drafts.get(r, [])[:1], 500] for i, r in enumerate(req_ids)]
        outputs = sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled))
        finished = {o.request_id for o in outputs if o.finished}
        proposals = {
            r: [7] * k for i, r in enumerate(req_ids) if not chunk[i] and r not in finished
        }
        if proposals:
            sched.update_draft_token_ids(proposals)
    return log


def test_fake_device_follows_a_real_scheduler(seeded_rng):
    _, rng = seeded_rng
    sched = make_scheduler(3, max_num_batched_tokens=32)
    dbt = DeviceBlockTable.from_config(sched.config, "cpu", mirror=True, max_ranges=1)
    assert (dbt.max_num_reqs, dbt.width) == (8, WIDTH)
    log = _serve(sched, dbt, rng, 30)
    copied = [rows for rows, _ in log]
    assert 0 in copied  # some steps change no row at all
    assert sum(copied) < sum(n for _, n in log) / 2  # far fewer rows than a full rebuild
    assert dbt.total_rows_copied == sum(copied)


# ---------------------------------------------------------------------------------------------
# GPU: pinned host mirror, non-blocking copies


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_pinned_non_blocking_path(seeded_rng):
    _, rng = seeded_rng
    sched = make_scheduler(3, max_num_batched_tokens=32)
    dbt = DeviceBlockTable.from_config(sched.config, "cuda", max_ranges=2)
    assert dbt.mirror and dbt.device.type == "cuda"
    assert dbt.host_table.is_pinned() and dbt.host_counts.is_pinned()
    assert dbt.table.is_cuda and dbt.counts.is_cuda
    log = _serve(sched, dbt, rng, 30)
    assert sum(rows for rows, _ in log) > 0

    # The glue on the GPU, through the device table, agrees with the CPU reference.
    sched = make_scheduler(3)
    for i in range(5):
        sched.add_request(Request(f"g{i}", rng.integers(10, 900, 9 + 11 * i).tolist(), 4))
    out = sched.schedule()
    dbt = DeviceBlockTable.from_config(sched.config, "cuda")
    anchors = rng.integers(100, 1000, out.num_reqs)
    common = dict(next_token_ids=anchors, mask_token_id=MASK, strict=True)
    gpu = expand_from_output(out, sched.config, block_table=dbt, **common)
    cpu = expand_from_output(out, sched.config, backend="reference", **common)
    torch.cuda.synchronize()
    assert gpu.query_slot_mapping.is_cuda
    for name in ("query_slot_mapping", "context_slot_mapping", "query_positions", "input_ids"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name))
    assert gpu.num_violations.item() == 0
