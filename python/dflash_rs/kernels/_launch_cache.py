"""Launch plans cached per output buffer set, so a repeated eager call skips what it repeats.

``expand_dflash_inputs(..., out=buffers)`` checks its arguments, plans the launch (grid,
scalars, constexprs) and launches through Triton's JIT, which binds the arguments and computes
a specialisation key in Python: 40-65 us of host time per call on an H200's host, against a
kernel of 2 us. Every one of those steps is a function of the call's *signature*: the
metadata of each tensor (data pointer alignment, shape, strides, dtype, device) and the scalar
arguments. So a plan is kept in ``out._launch_plans`` under that signature, and a call whose
signature was seen before launches the plan's compiled kernel with nothing else to do.

What the signature holds, and why it is enough:

- The structural argument checks read only tensor metadata (types, dtypes, dims, devices,
  contiguity, sizes and strides), which the signature holds exactly. So a call that matches a
  checked signature would pass the checks, and any change of a buffer (another tensor, or the
  same tensor resized, restrided or replaced in place through ``set_``, ``resize_`` or
  ``.data``) changes the signature and is checked again.
- Triton specialises a kernel on each pointer's 16-byte alignment and on integer values (1, or
  divisible by 16); the pointers' ``data_ptr() % 16`` are in the signature and every integer
  the kernel takes is a function of it, so the plan's compiled kernel is the one the JIT would
  pick. The data pointers themselves may change freely between calls.
- Scalars must be exact ``int`` (``bool`` for ``accumulate_violations``): ``16.0 == 16`` and
  ``True == 1`` in a dict key, and such calls go to the checks, which refuse them.
- Value checks (``validate=True``) read tensor *data*, which the signature cannot see; they
  run on every call that asks for them.

A call that is not eligible (a non-tensor argument, a scalar of another type) takes the full
path, which raises the typed error or launches as before. The cache holds no tensors, only
metadata and ints, so it keeps no caller's memory alive; it is bounded per buffer set.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["MAX_PLANS", "call_signature"]

MAX_PLANS = 64
"""Plans kept per buffer set; the oldest is dropped past this (batch shapes of a padded engine
are a few dozen)."""


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
) -> Optional[tuple[tuple, tuple, tuple]]:
    """``(signature, kernel pointer arguments, their data pointers)`` of an eligible call with
    ``out`` given, or None. The pointer arguments are in the kernel's order; an absent optional
    input is given next_token_ids (its flag in the signature says it is absent)."""
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
        g, h, i = out.input_ids, out.query_positions, out.query_slot_mapping
        j, k = out.context_positions, out.context_slot_mapping
        m, n = out.token_indices_to_sample, out.violation_partials
        pointers = (
            a.data_ptr(), b.data_ptr(), c.data_ptr(), d.data_ptr(), e.data_ptr(), f.data_ptr(),
            g.data_ptr(), h.data_ptr(), i.data_ptr(), j.data_ptr(), k.data_ptr(), m.data_ptr(),
            n.data_ptr(),
        )  # fmt: skip
        signature = (
            backend, block_size, num_speculative_tokens, mask_token_id, max_model_len,
            accumulate_violations, rejected is None, per_row is None, out.num_speculative_tokens,
            a.shape, a.stride(), a.dtype, a.device,
            b.shape, b.stride(), b.dtype, b.device,
            c.shape, c.stride(), c.dtype, c.device,
            d.shape, d.stride(), d.dtype, d.device,
            None if rejected is None else (e.shape, e.stride(), e.dtype, e.device),
            None if per_row is None else (f.shape, f.stride(), f.dtype, f.device),
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
    except Exception:  # not tensors (or tensors without storage): the full path says why
        return None
    return signature, (a, b, c, d, e, f, g, h, i, j, k, m, n), pointers
