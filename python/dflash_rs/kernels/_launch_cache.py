"""Launch plans cached per output buffer set, so a repeated eager call skips what it repeats.

``expand_dflash_inputs(..., out=buffers)`` checks its arguments, plans the launch (grid,
scalars, constexprs) and launches through Triton's JIT, which binds the arguments and computes
a specialisation key in Python: 70-120 us of host time per call on the H200 machine, for a
kernel of 2 us. All of it but the batch's size follows from the call's *signature*: each
tensor's metadata and the scalar arguments. So a plan (``dflash_expand.ExpandLaunch``) is kept
in ``out._launch_plans`` under that signature; a call whose signature was seen before checks
only its sizes (``sizes_fit``) and launches the plan's compiled kernel.

What the signature holds, and why it is enough:

- The structural checks read only metadata: types, dtypes, dims, devices, contiguity, strides
  and sizes. The signature holds all of it exactly but the inputs' sizes, which follow the batch
  (an engine passes slices of persistent buffers): for those it holds dims and contiguity, and
  for the block table its width, strides and whether it has more than one row, which is what
  the checks read besides. The checks that read sizes are few comparisons, made on every call
  by ``sizes_fit``. So a call that matches a checked signature and fits passes the checks, and
  any change of a buffer (another tensor, or one resized, restrided, retyped or moved in place
  through ``resize_``, ``as_strided_``, ``.data`` or ``torch.utils.swap_tensors``) is a new
  signature or does not fit, and is checked again, raising the same error.
- Triton specialises a kernel on each pointer's 16-byte alignment and on the values of the
  integers it does not mark ``do_not_specialize`` (1, or divisible by 16): the pointers'
  ``data_ptr() % 16`` are in the signature, and those integers (the table's stride and width)
  too; the ``do_not_specialize`` ones only choose 32 or 64 bits, and the batch sizes are under
  2**31 (the checks bound them by the buffers). The constexprs that depend on the batch size
  pick one compiled kernel each. So a plan launches the kernel the JIT would pick. The data
  pointers themselves may change freely between calls.
- Scalars must be exact ``int`` (``bool`` for ``accumulate_violations``): ``16.0 == 16`` and
  ``True == 1`` in a dict key, so such calls go to the checks, which refuse them.
- Value checks (``validate=True``) read tensor *data*, which no signature holds; they run on
  every call that asks for them.

A call that is not eligible (a non-tensor argument, a scalar of another type) or that does not
fit takes the full path, which raises the typed error or launches as before. The cache holds
no tensors, only metadata and ints, so it keeps no caller's memory alive; it is bounded per
buffer set (``MAX_PLANS`` signatures, ``MAX_BATCH_SHAPES`` batch sizes per plan).
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["MAX_PLANS", "call_signature", "sizes_fit"]

MAX_PLANS = 64
"""Plans kept per buffer set; the oldest is dropped past this. An engine has one or a few
signatures per buffer set (strict or not, with or without rejected counts)."""


def call_signature(
    next_token_ids: Any,
    target_positions: Any,
    query_start_loc: Any,
    block_table: Any,
    num_rejected_tokens: Any,
    num_blocks_per_row: Any,
    out: Any,
    block_size: Any,
    num_speculative_tokens: Any,
    mask_token_id: Any,
    max_model_len: Any,
    accumulate_violations: Any,
    backend: str,
) -> Optional[tuple[tuple, tuple, tuple, tuple]]:
    """``(signature, kernel pointer arguments, their data pointers, sizes)`` of an eligible call
    with ``out`` given, or None.

    The pointer arguments are in the kernel's order; an absent optional input is given
    next_token_ids (its flag in the signature says it is absent). ``sizes`` are the shapes of
    next_token_ids, target_positions, query_start_loc, block_table, num_rejected_tokens and
    num_blocks_per_row (None where absent), for ``sizes_fit``.
    """
    if not (
        type(block_size) is int
        and type(num_speculative_tokens) is int
        and type(mask_token_id) is int
        and (max_model_len is None or type(max_model_len) is int)
        and type(accumulate_violations) is bool
    ):
        return None
    rejected, per_row = num_rejected_tokens, num_blocks_per_row
    try:
        a, b, c, d = next_token_ids, target_positions, query_start_loc, block_table
        e = a if rejected is None else rejected
        f = a if per_row is None else per_row
        # The buffers in BUFFER_NAMES order, read one by one: on this per-call path plain
        # attribute reads cost a fifth of a call to buffer_tensors (tests/kernels check the order).
        g, h, i = out.input_ids, out.query_positions, out.query_slot_mapping
        j, k = out.context_positions, out.context_slot_mapping
        m, n = out.token_indices_to_sample, out.violation_partials
        pointers = (
            a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), e.data_ptr(), f.data_ptr(),
            g.data_ptr(), h.data_ptr(), i.data_ptr(), j.data_ptr(), k.data_ptr(), m.data_ptr(),
            n.data_ptr(),
        )  # fmt: skip
        sa, sb, sc, sd = a.shape, b.shape, c.shape, d.shape
        se = None if rejected is None else e.shape
        sf = None if per_row is None else f.shape
        # The inputs' sizes follow the batch: the signature holds what the checks read besides
        # (dims, contiguity, dtype, device; the table's width, strides and whether it has more
        # than one row), and sizes_fit checks the sizes on every call.
        signature = (
            backend, block_size, num_speculative_tokens, mask_token_id, max_model_len,
            accumulate_violations, out.num_speculative_tokens,
            len(sa), a.is_contiguous(), a.dtype, a.device,
            len(sb), b.is_contiguous(), b.dtype, b.device,
            len(sc), c.is_contiguous(), c.dtype, c.device,
            len(sd), sd[1:], sd[0] > 1, d.stride(), d.dtype, d.device,
            None if se is None else (len(se), e.is_contiguous(), e.dtype, e.device),
            None if sf is None else (len(sf), f.is_contiguous(), f.dtype, f.device),
            g.shape, g.stride(), g.dtype, g.device,
            h.shape, h.stride(), h.dtype, h.device,
            i.shape, i.stride(), i.dtype, i.device,
            j.shape, j.stride(), j.dtype, j.device,
            k.shape, k.stride(), k.dtype, k.device,
            m.shape, m.stride(), m.dtype, m.device,
            n.shape, n.stride(), n.dtype, n.device,
            pointers[0] & 15, pointers[1] & 15, pointers[2] & 15, pointers[3] & 15,
            pointers[4] & 15, pointers[5] & 15, pointers[6] & 15, pointers[7] & 15,
            pointers[8] & 15, pointers[9] & 15, pointers[10] & 15, pointers[11] & 15,
            pointers[12] & 15,
        )  # fmt: skip
    except Exception:  # not tensors, a 0-D table, no storage: the full path says why
        return None
    return signature, (a, b, c, d, e, f, g, h, i, j, k, m, n), pointers, (sa, sb, sc, sd, se, sf)


def sizes_fit(sizes: tuple, max_num_reqs: int, max_num_ctx: int) -> bool:
    """Whether a call of a checked signature with these sizes passes the checks that read
    sizes: query_start_loc has num_reqs + 1 entries, the table at least num_reqs rows,
    num_rejected_tokens num_reqs entries and num_blocks_per_row at least num_reqs, and the
    output buffers hold the batch. (Sizes of 1-D tensors: the signature fixed their dims.)"""
    ids, positions, qsl, table, rejected, per_row = sizes
    num_reqs = ids[0]
    return (
        qsl[0] == num_reqs + 1
        and table[0] >= num_reqs
        and (rejected is None or rejected[0] == num_reqs)
        and (per_row is None or per_row[0] >= num_reqs)
        and num_reqs <= max_num_reqs
        and positions[0] <= max_num_ctx
    )
