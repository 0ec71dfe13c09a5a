"""Triton kernel for the DFlash first-pass input expansion, and its launcher.

Layout: one 1-D launch. The first programs each own a flat tile of query lanes (request =
lane // (K+1), no per-request programs); the rest each own a flat tile of context lanes and find
each lane's request in ``query_start_loc`` (one probe resolves uniform batches, a two-stage search
resolves the rest). A launch is latency bound: tiles hold one lane per thread, every load is issued
as early as its inputs allow, and 1024 decode requests (K=8) take 144 programs, about one wave.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dflash_rs.kernels._validate import ExpandArgs
from dflash_rs.kernels.result import DFlashInputs

__all__ = ["launch_expand_kernel"]

# One lane per thread: a launch is latency bound and a warp issues its lanes' instructions in
# sequence, so wider tiles per thread cost more than extra programs (measured on an H200).
QUERY_TILE = 128
CONTEXT_TILE = 128
# Request starts sampled by the coarse search stage; a [CONTEXT_TILE, COARSE_SAMPLES] compare.
# 32 beat 16, 8 and a plain binary search (1) on an H200; 2-D work is costly in this kernel, so
# it runs only in tiles whose one-probe guess missed.
COARSE_SAMPLES = 32
NUM_WARPS = 4
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
def _search_rows(
    lanes,
    active,
    query_start_loc_ptr,
    num_reqs,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
):
    """Last row r < num_reqs with query_start_loc[r] <= lane (query_start_loc sorted)."""
    STRIDE: tl.constexpr = REQ_SPAN // COARSE
    rows = tl.zeros_like(lanes)
    if COARSE > 1:
        # Coarse stage: one broadcast load of every STRIDE-th start, compared in registers.
        sample_rows = tl.arange(0, COARSE) * STRIDE
        samples = tl.load(
            query_start_loc_ptr + sample_rows, mask=sample_rows < num_reqs, other=_INT32_MAX
        )
        below = (samples[None, :] <= lanes[:, None]).to(tl.int32)
        rows = tl.maximum(tl.sum(below, axis=1) - 1, 0) * STRIDE
    # Fine stage: branch-free binary search within the STRIDE rows the coarse stage picked.
    for level in tl.static_range(FINE_STEPS):
        probe = rows + (STRIDE >> (level + 1))
        start = tl.load(
            query_start_loc_ptr + probe, mask=active & (probe < num_reqs), other=_INT32_MAX
        )
        rows = tl.where(start <= lanes, probe, rows)
    return rows


@triton.jit
def _publish_violations(num_bad, num_violations_ptr, violation_scratch_ptr):
    """Sum per-program counts with one atomic each; the last program publishes and resets."""
    # High 32 bits count finished programs, low 32 bits count violations.
    ticket = tl.atomic_add(violation_scratch_ptr, num_bad.to(tl.int64) + (1 << 32), sem="relaxed")
    finished = ticket >> 32
    if finished == tl.num_programs(0) - 1:
        total = ticket - (finished << 32) + num_bad
        tl.store(num_violations_ptr, total.to(tl.int32))
        # Zero again, so the next launch (or CUDA-graph replay) needs no memset.
        tl.atomic_xchg(violation_scratch_ptr, 0, sem="relaxed")


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
    context_capacity,
    table_stride,
    table_width,
    max_model_len,
    KV_BLOCK: tl.constexpr,
    TILE: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
):
    """Context lanes: positions are copied, rows found in query_start_loc; returns violations."""
    lanes = tile * TILE + tl.arange(0, TILE)
    in_capacity = lanes < context_capacity
    in_batch = lanes < num_ctx
    positions = tl.load(target_positions_ptr + lanes, mask=in_batch, other=0)
    batch_start = tl.load(query_start_loc_ptr)
    batch_end = tl.load(query_start_loc_ptr + num_reqs)
    searchable = in_batch & (num_reqs > 0)
    # Probe: in a uniform batch (equal context lengths) row = lane * num_reqs // num_ctx.
    guess = (lanes.to(tl.int64) * num_reqs // tl.maximum(num_ctx, 1)).to(tl.int32)
    guess = tl.minimum(guess, num_reqs - 1)
    guess_start = tl.load(query_start_loc_ptr + guess, mask=searchable, other=0)
    guess_end = tl.load(query_start_loc_ptr + guess + 1, mask=searchable, other=0)
    missed = searchable & ((guess_start > lanes) | (lanes >= guess_end))
    rows = guess
    if tl.max(missed.to(tl.int32), axis=0) > 0:
        rows = _search_rows(
            lanes, searchable, query_start_loc_ptr, num_reqs, REQ_SPAN, COARSE, FINE_STEPS
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
        "query_capacity",
        "context_capacity",
        "num_query_programs",
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
    num_violations_ptr,
    violation_scratch_ptr,
    num_reqs,
    num_ctx,
    query_capacity,
    context_capacity,
    num_query_programs,
    table_stride,
    table_width,
    mask_token_id,
    max_model_len,
    NUM_SPEC: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    QUERY_TILE_: tl.constexpr,
    CONTEXT_TILE_: tl.constexpr,
    REQ_SPAN: tl.constexpr,
    COARSE: tl.constexpr,
    FINE_STEPS: tl.constexpr,
    HAS_REJECTED: tl.constexpr,
    STRICT: tl.constexpr,
    HAS_MAX_LEN: tl.constexpr,
    ACCUMULATE: tl.constexpr,
):
    pid = tl.program_id(0)
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
            QUERY_TILE_,
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
            context_capacity,
            table_stride,
            table_width,
            max_model_len,
            KV_BLOCK,
            CONTEXT_TILE_,
            REQ_SPAN,
            COARSE,
            FINE_STEPS,
            STRICT,
            HAS_MAX_LEN,
        )
    if STRICT:
        if ACCUMULATE:
            # No zeroing, no ticket: only programs that found violations touch the counter.
            if num_bad > 0:
                tl.atomic_add(num_violations_ptr, num_bad, sem="relaxed")
        else:
            _publish_violations(num_bad, num_violations_ptr, violation_scratch_ptr)
    elif pid == 0:
        tl.store(num_violations_ptr, 0)


def _next_power_of_2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


def launch_expand_kernel(args: ExpandArgs) -> DFlashInputs:
    """Fill ``args.out`` with one kernel launch (no host synchronisation) and return it."""
    out = args.out
    query_capacity = out.input_ids.numel()
    context_capacity = out.context_positions.numel()
    num_query_programs = triton.cdiv(query_capacity, QUERY_TILE)
    num_context_programs = triton.cdiv(context_capacity, CONTEXT_TILE)
    # At least one program: it writes num_violations even for an empty batch.
    grid = (max(1, num_query_programs + num_context_programs),)
    req_span = max(COARSE_SAMPLES, _next_power_of_2(args.num_reqs))
    fine_steps = (req_span // COARSE_SAMPLES).bit_length() - 1
    # Absent optional inputs: any valid pointer; the constexpr flags compile their loads away.
    placeholder = args.next_token_ids
    num_rejected = args.num_rejected_tokens
    per_row = args.num_blocks_per_row
    table = args.block_table

    def launch() -> None:
        _dflash_expand_kernel[grid](
            args.next_token_ids,
            args.target_positions,
            args.query_start_loc,
            table,
            placeholder if num_rejected is None else num_rejected,
            placeholder if per_row is None else per_row,
            out.input_ids,
            out.query_positions,
            out.query_slot_mapping,
            out.context_positions,
            out.context_slot_mapping,
            out.token_indices_to_sample,
            out.num_violations,
            out.violation_scratch,
            args.num_reqs,
            args.num_ctx,
            query_capacity,
            context_capacity,
            num_query_programs,
            table.stride(0),
            table.shape[1],
            args.mask_token_id,
            args.max_model_len if args.max_model_len is not None else 0,
            NUM_SPEC=args.num_speculative_tokens,
            KV_BLOCK=args.block_size,
            QUERY_TILE_=QUERY_TILE,
            CONTEXT_TILE_=CONTEXT_TILE,
            REQ_SPAN=req_span,
            COARSE=COARSE_SAMPLES,
            FINE_STEPS=fine_steps,
            HAS_REJECTED=num_rejected is not None,
            STRICT=per_row is not None,
            HAS_MAX_LEN=args.max_model_len is not None,
            ACCUMULATE=args.accumulate_violations,
            num_warps=NUM_WARPS,
        )

    if args.device.type == "cuda":
        with torch.cuda.device(args.device):
            launch()
    else:  # TRITON_INTERPRET=1 on CPU tensors
        launch()
    return out
