#!/usr/bin/env python3
"""Instructions the drop-in's timed calls execute per step, counted by valgrind's callgrind:
deterministic where wall and CPU time on a shared host are not, so two builds compare exactly.

``vllm_dropin.py`` runs as usual (same workload, same phases) with callgrind collecting only
inside the timed phases of measured steps (``vllm_dropin.PHASE_HOOK``), through callgrind's
client requests from a small C shim compiled on the fly (``cc`` and valgrind's headers, as in
Debian's ``valgrind`` package). Run one side; the instructions per step are callgrind's
"Collected" total over ``--measure-steps`` x ``--reps``:

    valgrind --tool=callgrind --instr-atstart=no --collect-atstart=no \\
        --callgrind-out-file=cg.out .venv-vllm/bin/python benches/callgrind_dropin.py \\
        --sides dflash-rs --n 1024 --modes decode --reps 1 --measure-steps 20
    callgrind_annotate --inclusive=yes cg.out | head -40

Under valgrind SHA-256 runs without the CPU's SHA extensions (valgrind does not emulate
them), so ``compress256`` counts far more than it costs natively; subtract it to compare the
rest.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = """
#include <valgrind/callgrind.h>
void dflash_cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void dflash_cg_toggle(void) { CALLGRIND_TOGGLE_COLLECT; }
"""


def load_shim(root: str) -> ctypes.CDLL:
    src, lib = os.path.join(root, "shim.c"), os.path.join(root, "libshim.so")
    with open(src, "w") as f:
        f.write(SHIM)
    subprocess.run(["cc", "-O1", "-shared", "-fPIC", "-o", lib, src], check=True)
    return ctypes.CDLL(lib)


def main(argv: list[str]) -> int:
    sys.path.insert(0, HERE)
    import vllm_dropin

    with tempfile.TemporaryDirectory(prefix="dflash-rs-cg-") as root:
        shim = load_shim(root)
        started = False

        def hook(entering: bool) -> None:
            nonlocal started
            if entering and not started:
                shim.dflash_cg_start()
                started = True
            shim.dflash_cg_toggle()

        vllm_dropin.PHASE_HOOK = hook
        return vllm_dropin.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
