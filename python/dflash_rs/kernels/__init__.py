"""Triton kernels of dflash-rs (importable as ``dflash_rs.kernels``).

``expand_dflash_inputs`` builds the DFlash drafter's first-pass inputs (query lanes, positions and
KV slots); ``expand_dflash_inputs_reference`` is the same function in pure torch. Triton is
imported only when the kernel runs, so this package imports without it.
"""

from __future__ import annotations

from dflash_rs.kernels.api import expand_dflash_inputs, triton_available
from dflash_rs.kernels.block_table import BlockTableCopyStats, DeviceBlockTable, shared_tensor
from dflash_rs.kernels.reference import expand_dflash_inputs_reference
from dflash_rs.kernels.result import PAD_POSITION, PAD_SLOT_ID, PAD_TOKEN_ID, DFlashInputs
from dflash_rs.kernels.step_inputs import (
    KernelInputs,
    context_positions,
    expand_from_output,
    kernel_inputs_from_output,
)

__all__ = [
    "PAD_POSITION",
    "PAD_SLOT_ID",
    "PAD_TOKEN_ID",
    "BlockTableCopyStats",
    "DFlashInputs",
    "DeviceBlockTable",
    "KernelInputs",
    "context_positions",
    "expand_dflash_inputs",
    "expand_dflash_inputs_reference",
    "expand_from_output",
    "kernel_inputs_from_output",
    "shared_tensor",
    "triton_available",
]
