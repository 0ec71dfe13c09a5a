"""Triton kernels of dflash-rs (importable as ``dflash_rs.kernels``)."""
