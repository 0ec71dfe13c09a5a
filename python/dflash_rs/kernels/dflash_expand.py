"""Triton kernel for the DFlash first-pass input expansion, and its launcher.

Layout: one 1-D launch. The first programs each own a flat tile of query lanes (request =
lane // (K+1), no search); the rest each own a flat tile of context lanes, whose requests form a
contiguous run of rows. A context tile finds them with a binary search in a window of up to 64 rows
of ``query_start_loc`` around the row a uniform batch would give the tile: three scalar loads,
issued with the position load, say whether the window covers the tile and bring its cache lines
into L1, so the search costs a few L1 hits instead of a chain of L2 round trips. A tile the window
misses (skewed batches) takes the window at the coarse sample below its first lane (one more
round trip); one that spans more rows than a window searches lane by lane. Batches of under four
context tokens a request first probe each lane's uniform-batch row.

Every program writes its strict-mode violation count (0 in default mode) to its own slot of
``violation_partials``: no atomics and no memset; ``DFlashInputs.num_violations`` sums the slots.

A launch is latency bound: tiles hold one lane per thread, every load is issued as early as its
inputs allow, and 1024 decode requests (K=8) take 144 programs, about one wave. A query lane
needs three dependent loads (query_start_loc, its last position, its block-table entry); a
context lane two (its position and window, its block-table entry) plus the L1 search.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_rs.kernels import _grid
from dflash_rs.kernels._validate import ExpandArgs
from dflash_rs.kernels.result import DFlashInputs

__all__ = ["MAX_BATCH_SHAPES", "ExpandLaunch", "kernel_tensors", "launch_expand_kernel"]

# Request starts sampled once per context tile, for skewed batches and the per-lane fallback.
COARSE_SAMPLES = 32
# Rows of query_start_loc a context tile's window holds: the next power of two of the rows a tile
# spans on average plus WINDOW_MARGIN (room for the guess to be off), at most MAX_WINDOW. A tile of
# requests of 4 or more context tokens spans at most 32 rows. The binary search costs log2(window)
# - 1 L1 hits, and each shows on an H200: 1024 decodes of 9 tokens (14 rows a tile) ran about
# 0.15 us faster with a 32-row window than with 64 rows (benches/gpu/sweep_expand.py).
MAX_WINDOW = 64
WINDOW_MARGIN = 16
# When a tile spans more rows than this on average (under 4 context tokens a request), probe each
# lane's uniform-batch row first; the windows serve only if a lane missed.
PROBE_SPAN = 32
NUM_WARPS = 4
ZERO_TILE = 128  # violation slots past the grid that program 0 zeroes per step
_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)


@triton.jit
def _slot_of(
    positions,
    rows,
    live,
    owned_blocks,
    block_table_ptr,
    table_stride,
    table_width,
    max_model_len,
    KV_BLOCK: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
):
    """KV slot of each lane's position through its table row, and which lanes are violations."""
    logical_block = positions // KV_BLOCK
    offset = positions - logical_block * KV_BLOCK
    row_start = block_table_ptr + rows.to(tl.int64) * table_stride
    if STRICT:
        # Read any in-table column without waiting for owned_blocks; judge afterwards.
        in_table = live & (positions >= 0) & (logical_block < table_width)
        block_id = tl.load(row_start + logical_block, mask=in_table, other=0)
        ok = in_table & (logical_block < owned_blocks) & (block_id > 0)
        if HAS_MAX_LEN:
            ok = ok & (positions < max_model_len)
    else:
        # vLLM's contract: clamp to the row's last column (negative positions get no slot).
        ok = live & (positions >= 0)
        column = tl.minimum(logical_block, table_width - 1)
        block_id = tl.load(row_start + column, mask=ok, other=0)
    slots = tl.where(ok, block_id.to(tl.int64) * KV_BLOCK + offset, -1)
    return slots, live & (ok == 0)


@triton.jit
def _search_window(
    lanes,
    base,
    middle_start,
    query_start_loc_ptr,
    WINDOW: tl.constexpr,
    WINDOW_LOG2: tl.constexpr,
):
    """Last row r in [base, base + WINDOW) with query_start_loc[r] <= lane, for lanes with
    query_start_loc[base] <= lane: a branch-free binary search (base + WINDOW <= num_reqs + 1,
    so its loads need no mask).

    ``middle_start`` is query_start_loc[base + WINDOW // 2], loaded by the caller with the
    window's first and next starts: those three scalar loads also bring every cache line of the
    window into L1, so the remaining log2(WINDOW) - 1 steps are L1 hits.
    """
    HALF: tl.constexpr = WINDOW // 2
    rows = tl.where(middle_start <= lanes, base + HALF, base)
    for level in tl.static_range(1, WINDOW_LOG2):
        probe = rows + (HALF >> level)
        start = tl.load(query_start_loc_ptr + probe)
        rows = tl.where(start <= lanes, probe, rows)
    return rows


@triton.jit
def _search_rows(
    lanes,
    active,
    query_start_loc_ptr,
    num_reqs,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
):
    """Last row r < num_reqs with query_start_loc[r] <= lane, lane by lane (the fallback).

    A compare with every STRIDE-th start picks STRIDE rows; a branch-free binary search
    finishes there.
    """
    STRIDE: tl.constexpr = REQ_SPAN // COARSE
    sample_rows = tl.arange(0, COARSE) * STRIDE
    samples = tl.load(
        query_start_loc_ptr + sample_rows, mask=sample_rows < num_reqs, other=_INT32_MAX
    )
    below = (samples[:, None] <= lanes[None, :]).to(tl.int32)
    rows = tl.maximum(tl.sum(below, axis=0) - 1, 0) * STRIDE
    for level in tl.static_range(FINE_STEPS):
        probe = rows + (STRIDE >> (level + 1))
        start = tl.load(
            query_start_loc_ptr + probe, mask=active & (probe < num_reqs), other=_INT32_MAX
        )
        rows = tl.where(start <= lanes, probe, rows)
    return rows


@triton.jit
def _rows_from_windows(
    lanes,
    searchable,
    first_lane,
    last_lane,
    samples,
    covered,
    base,
    middle_start,
    query_start_loc_ptr,
    num_reqs,
    WINDOW: tl.constexpr,
    WINDOW_LOG2: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
):
    """Rows of the tile's lanes from the stage-1 window if it covers the tile, else from the
    window at the coarse sample at or below the tile's first lane, else lane by lane."""
    STRIDE: tl.constexpr = REQ_SPAN // COARSE
    if covered:
        rows = _search_window(lanes, base, middle_start, query_start_loc_ptr, WINDOW, WINDOW_LOG2)
    else:
        bucket = tl.sum((samples <= first_lane).to(tl.int32), axis=0) - 1
        last_base = num_reqs + 1 - WINDOW
        base = tl.maximum(tl.minimum(bucket * STRIDE, last_base), 0)
        middle_start = tl.load(query_start_loc_ptr + base + WINDOW // 2)
        window_next = tl.load(
            query_start_loc_ptr + base + WINDOW, mask=base < last_base, other=_INT32_MAX
        )
        if (bucket >= 0) & (last_lane < window_next):
            rows = _search_window(
                lanes, base, middle_start, query_start_loc_ptr, WINDOW, WINDOW_LOG2
            )
        else:
            rows = _search_rows(
                lanes, searchable, query_start_loc_ptr, num_reqs, REQ_SPAN, COARSE, FINE_STEPS
            )
    return rows


@triton.jit
def _context_rows(
    lanes,
    positions,
    first_lane,
    in_batch,
    query_start_loc_ptr,
    num_reqs,
    num_ctx,
    rows_per_lane,
    TILE: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_LOG2: tl.constexpr,
    PROBE: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
):
    """Row of each context lane: the last r < num_reqs with query_start_loc[r] <= lane."""
    STRIDE: tl.constexpr = REQ_SPAN // COARSE
    HALF: tl.constexpr = WINDOW // 2
    # A [TILE] int1 tensor: a scalar comparison in the mix gives a mask Triton 3.9's
    # interpreter refuses ("mask has unsupported dtype").
    searchable = in_batch & (tl.full([TILE], num_reqs, tl.int32) > 0)
    last_lane = tl.minimum(first_lane + TILE, num_ctx) - 1
    # Every load the lookup may need is issued up front, next to the position load: the coarse
    # samples (a lane or none per thread) and three scalars of the stage-1 window, which is
    # centred on the uniform-batch row of the tile's middle lane (a float guess is enough:
    # rows_per_lane = num_reqs / num_ctx) and holds rows [base, base + WINDOW), base + WINDOW
    # <= num_reqs + 1.
    sample_rows = tl.arange(0, COARSE) * STRIDE
    samples = tl.load(
        query_start_loc_ptr + sample_rows, mask=sample_rows < num_reqs, other=_INT32_MAX
    )
    last_base = num_reqs + 1 - WINDOW
    guess = (((first_lane + last_lane) // 2).to(tl.float32) * rows_per_lane).to(tl.int32)
    base = tl.maximum(tl.minimum(guess - HALF, last_base), 0)
    window_first = tl.load(query_start_loc_ptr + base)
    middle_start = tl.load(query_start_loc_ptr + base + HALF)
    window_next = tl.load(
        query_start_loc_ptr + base + WINDOW, mask=base < last_base, other=_INT32_MAX
    )
    # Both conditions below read all three scalars (the extra terms are false for a sorted
    # query_start_loc), so the compiler cannot sink their loads behind a branch.
    unsorted = (middle_start < window_first) | (window_next < middle_start)
    covered = (window_first <= first_lane) & (last_lane < window_next) & (unsorted == 0)
    # A lane with a negative position gets no slot in any mode, so its row does not matter:
    # searching first_lane for it makes the search wait for the position load, which keeps the
    # compiler from issuing that load only after the search.
    search_lanes = tl.where(positions < 0, first_lane, lanes)
    if PROBE:
        # About one row per lane or more (or chosen): probe each lane's uniform-batch row,
        # lane * num_reqs // num_ctx, exact for uniform batches; the windows if any lane missed.
        probe = (lanes.to(tl.int64) * num_reqs // tl.maximum(num_ctx, 1)).to(tl.int32)
        probe = tl.minimum(probe, num_reqs - 1)
        probe_start = tl.load(query_start_loc_ptr + probe, mask=searchable, other=0)
        probe_end = tl.load(query_start_loc_ptr + probe + 1, mask=searchable, other=0)
        missed = searchable & ((probe_start > lanes) | (lanes >= probe_end))
        rows = probe
        if (tl.max(missed.to(tl.int32), axis=0) > 0) | unsorted:
            rows = _rows_from_windows(
                search_lanes,
                searchable,
                first_lane,
                last_lane,
                samples,
                covered,
                base,
                middle_start,
                query_start_loc_ptr,
                num_reqs,
                WINDOW,
                WINDOW_LOG2,
                REQ_SPAN,
                COARSE,
                FINE_STEPS,
            )
    else:
        rows = _rows_from_windows(
            search_lanes,
            searchable,
            first_lane,
            last_lane,
            samples,
            covered,
            base,
            middle_start,
            query_start_loc_ptr,
            num_reqs,
            WINDOW,
            WINDOW_LOG2,
            REQ_SPAN,
            COARSE,
            FINE_STEPS,
        )
    return rows


@triton.jit
def _expand_query_tile(
    tile,
    next_token_ids_ptr,
    target_positions_ptr,
    query_start_loc_ptr,
    block_table_ptr,
    num_rejected_ptr,
    num_blocks_per_row_ptr,
    input_ids_ptr,
    query_positions_ptr,
    query_slots_ptr,
    token_indices_ptr,
    num_reqs,
    num_ctx,
    query_capacity,
    table_stride,
    table_width,
    mask_token_id,
    max_model_len,
    NUM_SPEC: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
):
    """Query lanes r*(K+1) + q (q = 0: bonus, 1..K: masks); returns the tile's violations."""
    NUM_QUERY: tl.constexpr = NUM_SPEC + 1
    lanes = tile * TILE + tl.arange(0, TILE)
    in_capacity = lanes < query_capacity
    rows = lanes // NUM_QUERY
    query_index = lanes - rows * NUM_QUERY
    real = rows < num_reqs
    # Issue every load that depends only on the row before the dependent position load.
    starts = tl.load(query_start_loc_ptr + rows, mask=real, other=0)
    ends = tl.load(query_start_loc_ptr + rows + 1, mask=real, other=0)
    valid_ends = ends
    if HAS_REJECTED:
        valid_ends = ends - tl.load(num_rejected_ptr + rows, mask=real, other=0)
    bonus = tl.load(next_token_ids_ptr + rows, mask=real & (query_index == 0), other=0)
    owned_blocks = 0
    if STRICT:
        owned_blocks = tl.load(num_blocks_per_row_ptr + rows, mask=real, other=0)
    # A row without a valid context token (CUDA-graph padding request) is all padding.
    live = real & (valid_ends > starts) & (valid_ends <= ends)
    live = live & (valid_ends >= 1) & (valid_ends <= num_ctx)
    last_position = tl.load(target_positions_ptr + valid_ends - 1, mask=live, other=0)
    positions = last_position + 1 + query_index
    slots, bad = _slot_of(
        positions,
        rows,
        live,
        owned_blocks,
        block_table_ptr,
        table_stride,
        table_width,
        max_model_len,
        KV_BLOCK,
        STRICT,
        HAS_MAX_LEN,
    )
    input_ids = tl.where(query_index == 0, bonus, mask_token_id)
    tl.store(input_ids_ptr + lanes, tl.where(live, input_ids, 0), mask=in_capacity)
    tl.store(query_positions_ptr + lanes, tl.where(live, positions, 0), mask=in_capacity)
    tl.store(query_slots_ptr + lanes, slots, mask=in_capacity)
    # Structural over the whole capacity: entry r*K + q - 1 samples lane r*(K+1) + q.
    tl.store(
        token_indices_ptr + rows * NUM_SPEC + query_index - 1,
        lanes,
        mask=in_capacity & (query_index > 0),
    )
    return tl.sum(bad.to(tl.int32), axis=0)


@triton.jit
def _expand_context_tile(
    tile,
    target_positions_ptr,
    query_start_loc_ptr,
    block_table_ptr,
    num_blocks_per_row_ptr,
    context_positions_ptr,
    context_slots_ptr,
    num_reqs,
    num_ctx,
    rows_per_lane,
    context_capacity,
    table_stride,
    table_width,
    max_model_len,
    KV_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_LOG2: tl.constexpr,
    PROBE: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
):
    """Context lanes: positions are copied, rows found in query_start_loc; returns violations."""
    first_lane = tile * TILE
    lanes = first_lane + tl.arange(0, TILE)
    in_capacity = lanes < context_capacity
    in_batch = lanes < num_ctx
    positions = tl.load(target_positions_ptr + lanes, mask=in_batch, other=0)
    batch_start = tl.load(query_start_loc_ptr)
    batch_end = tl.load(query_start_loc_ptr + num_reqs)
    rows = _context_rows(
        lanes,
        positions,
        first_lane,
        in_batch,
        query_start_loc_ptr,
        num_reqs,
        num_ctx,
        rows_per_lane,
        TILE,
        WINDOW,
        WINDOW_LOG2,
        PROBE,
        REQ_SPAN,
        COARSE,
        FINE_STEPS,
    )
    live = in_batch & (lanes >= batch_start) & (lanes < batch_end)
    owned_blocks = 0
    if STRICT:
        owned_blocks = tl.load(num_blocks_per_row_ptr + rows, mask=live, other=0)
    slots, bad = _slot_of(
        positions,
        rows,
        live,
        owned_blocks,
        block_table_ptr,
        table_stride,
        table_width,
        max_model_len,
        KV_BLOCK,
        STRICT,
        HAS_MAX_LEN,
    )
    tl.store(context_positions_ptr + lanes, positions, mask=in_capacity)
    tl.store(context_slots_ptr + lanes, slots, mask=in_capacity)
    return tl.sum(bad.to(tl.int32), axis=0)


@triton.jit(
    do_not_specialize=[
        "num_reqs",
        "num_ctx",
        "rows_per_lane",
        "query_capacity",
        "context_capacity",
        "num_query_programs",
        "num_programs",
        "num_slots",
        "mask_token_id",
        "max_model_len",
    ]
)
def _dflash_expand_kernel(
    next_token_ids_ptr,
    target_positions_ptr,
    query_start_loc_ptr,
    block_table_ptr,
    num_rejected_ptr,
    num_blocks_per_row_ptr,
    input_ids_ptr,
    query_positions_ptr,
    query_slots_ptr,
    context_positions_ptr,
    context_slots_ptr,
    token_indices_ptr,
    violation_partials_ptr,
    num_reqs,
    num_ctx,
    rows_per_lane,
    query_capacity,
    context_capacity,
    num_query_programs,
    num_programs,
    num_slots,
    table_stride,
    table_width,
    mask_token_id,
    max_model_len,
    NUM_SPEC: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    QUERY_TILE: tl.constexpr,
    CONTEXT_TILE: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_LOG2: tl.constexpr,
    PROBE: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    ZERO_TILE_: tl.constexpr,
):
    pid = tl.program_id(0)
    previous = 0
    if ACCUMULATE:
        # Issued first, so it overlaps the tile's loads; the slot is this program's alone.
        previous = tl.load(violation_partials_ptr + pid)
    if pid < num_query_programs:
        num_bad = _expand_query_tile(
            pid,
            next_token_ids_ptr,
            target_positions_ptr,
            query_start_loc_ptr,
            block_table_ptr,
            num_rejected_ptr,
            num_blocks_per_row_ptr,
            input_ids_ptr,
            query_positions_ptr,
            query_slots_ptr,
            token_indices_ptr,
            num_reqs,
            num_ctx,
            query_capacity,
            table_stride,
            table_width,
            mask_token_id,
            max_model_len,
            NUM_SPEC,
            KV_BLOCK,
            QUERY_TILE,
            HAS_REJECTED,
            STRICT,
            HAS_MAX_LEN,
        )
    else:
        num_bad = _expand_context_tile(
            pid - num_query_programs,
            target_positions_ptr,
            query_start_loc_ptr,
            block_table_ptr,
            num_blocks_per_row_ptr,
            context_positions_ptr,
            context_slots_ptr,
            num_reqs,
            num_ctx,
            rows_per_lane,
            context_capacity,
            table_stride,
            table_width,
            max_model_len,
            KV_BLOCK,
            CONTEXT_TILE,
            WINDOW,
            WINDOW_LOG2,
            PROBE,
            REQ_SPAN,
            COARSE,
            FINE_STEPS,
            STRICT,
            HAS_MAX_LEN,
        )
    # Each program owns one slot: a plain store, no atomics, and no memset before a launch.
    if STRICT:
        tl.store(violation_partials_ptr + pid, previous + num_bad)
    else:
        tl.store(violation_partials_ptr + pid, 0)
    if not ACCUMULATE:
        if pid == 0:
            # Slots past this grid (buffers shared with a larger DFlashInputs) must read 0 too.
            first = num_programs
            while first < num_slots:  # (a while loop also runs under TRITON_INTERPRET=1)
                slots = first + tl.arange(0, ZERO_TILE_)
                tl.store(violation_partials_ptr + slots, 0, mask=slots < num_slots)
                first += ZERO_TILE_


def _next_power_of_2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


# The kernel's parameters: 13 pointers (see kernel_tensors), 12 scalars (ExpandLaunch.scalars),
# then the constexprs.
POINTER_ARGS = 13
_CONSTEXPR_NAMES = tuple(_dflash_expand_kernel.arg_names[POINTER_ARGS + 12 :])
assert _dflash_expand_kernel.arg_names[POINTER_ARGS : POINTER_ARGS + 12] == [
    "num_reqs", "num_ctx", "rows_per_lane", "query_capacity", "context_capacity",
    "num_query_programs", "num_programs", "num_slots", "table_stride", "table_width",
    "mask_token_id", "max_model_len",
]  # fmt: skip
_get_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# Cleared for the process when a compiled kernel's launcher refuses the argument convention of
# the Triton version this was written against (3.6: every parameter, constexprs included).
_direct_launch_ok = _get_device is not None and _raw_stream is not None and hasattr(triton, "knobs")


def _knob_state() -> tuple:
    """The global Triton settings the JIT reads into a kernel's cache key on every launch."""
    return (triton.knobs.runtime.debug, triton.knobs.compilation.instrumentation_mode)


# Triton settings that change how a kernel compiles but not the JIT's cache key as seen here
# (Triton 3.9: the FP sanitizer's homomorphic casts, a hook on the compiler's stages). While one
# is set every launch goes through the JIT, and kernels it compiles are not kept.
_COMPILE_SETTINGS = (
    ("compilation", "fpsan_homomorphic_casts"),
    ("runtime", "add_stages_inspection_hook"),
)


def _compile_settings_set() -> bool:
    """Whether one of ``_COMPILE_SETTINGS`` that this Triton version has is set."""
    knobs = triton.knobs
    return any(getattr(getattr(knobs, group), name, None) for group, name in _COMPILE_SETTINGS)


_HookChain = getattr(getattr(triton, "knobs", None), "HookChain", None)


def _hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is set: those get the JIT's launch metadata.

    Triton 3.6 keeps an empty ``HookChain`` where earlier versions kept None."""
    runtime = triton.knobs.runtime
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and (type(hook) is not _HookChain or hook.calls):
            return True
    return False


class _BatchShape:
    """What a launch of one plan takes from the batch's size: the scalars, the constexprs that
    depend on it, and the key of the compiled kernel those constexprs select."""

    __slots__ = ("constexprs", "kernel_key", "scalars", "tail")

    def __init__(self, plan: ExpandLaunch, num_reqs: int, num_ctx: int) -> None:
        req_span = max(COARSE_SAMPLES, _next_power_of_2(num_reqs))
        # Rows a context tile spans on average.
        span = _grid.CONTEXT_TILE * num_reqs / max(num_ctx, 1)
        # Those rows plus room for the guess to be off; at most MAX_WINDOW, and at most the
        # largest power of two that fits query_start_loc (the search's loads have no mask).
        window = min(
            MAX_WINDOW,
            _next_power_of_2(int(span) + WINDOW_MARGIN),
            1 << (num_reqs + 1).bit_length() - 1,
        )
        varying = {
            "WINDOW": window,
            "WINDOW_LOG2": window.bit_length() - 1,
            "PROBE": span > PROBE_SPAN,
            "REQ_SPAN": req_span,
            "FINE_STEPS": (req_span // COARSE_SAMPLES).bit_length() - 1,
        }
        self.constexprs = {**plan.constexprs, **varying}
        self.kernel_key = tuple(varying.values())
        self.scalars = (num_reqs, num_ctx, num_reqs / max(num_ctx, 1), *plan.scalars)
        # Everything after the pointers, in the kernel's parameter order (constexprs included:
        # the launcher takes every parameter and skips those).
        self.tail = self.scalars + tuple(self.constexprs[name] for name in _CONSTEXPR_NAMES)


MAX_BATCH_SHAPES = 256  # batch sizes remembered per plan (the oldest is dropped past this)


class ExpandLaunch:
    """A launch plan: the grid, the scalars and the compiled kernels of every launch whose
    arguments have the metadata (but for the batch's size) of the checked ``args`` it is made
    from.

    Everything here follows from the buffers' metadata: the grid and most scalars from the
    output buffers and the table, the constexprs from the scalar arguments and, for a few, from
    the batch size (``_BatchShape``, memoised per size). ``expand_dflash_inputs`` keeps one per
    buffer set and call signature (``_launch_cache.py``), so a repeated eager call launches with
    ``launch`` and nothing else: no argument checks beyond the sizes, no Triton argument binding
    or cache key, no device context when the current device is already the tensors'. The first
    launch of each compiled variant goes through Triton's JIT, which compiles or finds it; later
    ones call its launcher directly, with raw pointers (the checks put every tensor on this
    CUDA device). The JIT path stays in use under the interpreter, with launch hooks installed
    (profilers), after a change of Triton's debug or instrumentation settings, while a setting
    of ``_COMPILE_SETTINGS`` is set, and if the launcher refuses the argument convention.
    """

    __slots__ = (
        "_kernels",
        "_shapes",
        "constexprs",
        "device",
        "device_index",
        "grid",
        "max_num_ctx",
        "max_num_reqs",
        "scalars",
    )

    def __init__(self, args: ExpandArgs) -> None:
        out = args.out
        query_capacity = out.input_ids.numel()
        context_capacity = out.context_positions.numel()
        # At least one program: it writes the violation slots even for an empty batch.
        num_programs = _grid.num_programs(query_capacity, context_capacity)
        table = args.block_table
        self.grid = (num_programs,)
        self.max_num_reqs = out.max_num_reqs
        self.max_num_ctx = context_capacity
        # The scalars after num_reqs, num_ctx and rows_per_lane.
        self.scalars = (
            query_capacity,
            context_capacity,
            triton.cdiv(query_capacity, _grid.QUERY_TILE),
            num_programs,
            out.violation_partials.numel(),
            table.stride(0),
            table.shape[1],
            args.mask_token_id,
            args.max_model_len if args.max_model_len is not None else 0,
        )
        self.constexprs = {
            "NUM_SPEC": args.num_speculative_tokens,
            "KV_BLOCK": args.block_size,
            "QUERY_TILE": _grid.QUERY_TILE,
            "CONTEXT_TILE": _grid.CONTEXT_TILE,
            "COARSE": COARSE_SAMPLES,
            "HAS_REJECTED": args.num_rejected_tokens is not None,
            "STRICT": args.num_blocks_per_row is not None,
            "HAS_MAX_LEN": args.max_model_len is not None,
            "ACCUMULATE": args.accumulate_violations,
            "ZERO_TILE_": ZERO_TILE,
        }
        self.device = args.device
        self.device_index = args.device.index if args.device.type == "cuda" else None
        self._shapes: dict[tuple[int, int], _BatchShape] = {}
        # kernel key -> (launcher, function handle, packed metadata, Triton settings)
        self._kernels: dict[tuple, tuple] = {}

    def batch_shape(self, num_reqs: int, num_ctx: int) -> _BatchShape:
        shape = self._shapes.get((num_reqs, num_ctx))
        if shape is None:
            if len(self._shapes) >= MAX_BATCH_SHAPES:
                del self._shapes[next(iter(self._shapes))]
            shape = self._shapes[num_reqs, num_ctx] = _BatchShape(self, num_reqs, num_ctx)
        return shape

    def launch_jit(self, tensors: tuple, num_reqs: int, num_ctx: int) -> None:
        """Launch through Triton's JIT (binds, specialises, compiles when new), and keep the
        compiled kernel for direct launches."""
        shape = self.batch_shape(num_reqs, num_ctx)

        def launch() -> object:
            return _dflash_expand_kernel[self.grid](
                *tensors, *shape.scalars, num_warps=NUM_WARPS, **shape.constexprs
            )

        if self.device_index is None:  # TRITON_INTERPRET=1 on CPU tensors: nothing to keep
            launch()
            return
        with torch.cuda.device(self.device_index):
            compiled = launch()
        if (
            _direct_launch_ok
            and shape.kernel_key not in self._kernels
            and not _compile_settings_set()
        ):
            function = getattr(compiled, "function", None)
            packed_metadata = getattr(compiled, "packed_metadata", None)
            if function is not None and packed_metadata is not None:
                entry = (compiled.run, function, packed_metadata, _knob_state())
                self._kernels[shape.kernel_key] = entry

    def launch(self, tensors: tuple, pointers: tuple, num_reqs: int, num_ctx: int) -> None:
        """Launch on ``tensors`` (the kernel's pointer arguments, in order), whose data pointers
        are ``pointers``: buffers of the metadata this plan was made for, holding a batch of
        ``num_reqs`` requests and ``num_ctx`` context tokens that fits them."""
        global _direct_launch_ok
        shape = self.batch_shape(num_reqs, num_ctx)
        compiled = self._kernels.get(shape.kernel_key)
        if (
            compiled is None
            or _hooks_installed()
            or _compile_settings_set()
            or _knob_state() != compiled[3]
        ):
            self.launch_jit(tensors, num_reqs, num_ctx)
            return
        run, function, packed_metadata = compiled[:3]
        index = self.device_index
        try:
            if _get_device() == index:
                run(
                    self.grid[0], 1, 1, _raw_stream(index), function, packed_metadata,
                    None, None, None, *pointers, *shape.tail,
                )  # fmt: skip
            else:
                with torch.cuda.device(index):
                    run(
                        self.grid[0], 1, 1, _raw_stream(index), function, packed_metadata,
                        None, None, None, *pointers, *shape.tail,
                    )  # fmt: skip
        except TypeError:
            # The launcher parses its arguments before launching: nothing ran. Another Triton
            # version's convention; use the JIT from now on.
            _direct_launch_ok = False
            self._kernels.clear()
            self.launch_jit(tensors, num_reqs, num_ctx)


def kernel_tensors(args: ExpandArgs) -> tuple:
    """The kernel's pointer arguments of ``args``, in order; an absent optional input gets
    next_token_ids (any valid pointer: the constexpr flags compile its loads away)."""
    out = args.out
    placeholder = args.next_token_ids
    rejected, per_row = args.num_rejected_tokens, args.num_blocks_per_row
    return (
        args.next_token_ids,
        args.target_positions,
        args.query_start_loc,
        args.block_table,
        placeholder if rejected is None else rejected,
        placeholder if per_row is None else per_row,
        # BUFFER_NAMES order, read one by one (cheaper than buffer_tensors on this per-call path)
        out.input_ids,
        out.query_positions,
        out.query_slot_mapping,
        out.context_positions,
        out.context_slot_mapping,
        out.token_indices_to_sample,
        out.violation_partials,
    )


def launch_expand_kernel(args: ExpandArgs) -> DFlashInputs:
    """Fill ``args.out`` with one kernel launch (no host synchronisation) and return it.

    Plans the launch afresh (reading the module's constants) and launches through the JIT.
    """
    ExpandLaunch(args).launch_jit(kernel_tensors(args), args.num_reqs, args.num_ctx)
    return args.out
