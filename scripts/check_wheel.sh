#!/usr/bin/env bash
# Installs the abi3 release wheel into a clean venv (numpy only) and checks that it holds
# everything `import dflash_rs` needs, the Triton kernels included, and not the dev build's
# test-only fault hook.
#
#   scripts/check_wheel.sh [WHEEL]    (default: build one into a temporary directory)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV_PY=${VENV_PY:-.venv/bin/python}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [[ -n ${1:-} ]]; then
    wheel=$(realpath "$1")
else
    source .venv/bin/activate
    maturin build --release --quiet -o "$out/dist"
    wheel=$(ls "$out"/dist/dflash_rs-*-abi3-*.whl)
    echo "built $(basename "$wheel")"
fi
python3 -m venv "$out/venv"
"$out/venv/bin/pip" install -q "$wheel"
cd "$out"
"$out/venv/bin/python" - <<'PY'
import importlib.resources as res
import dflash_rs
from dflash_rs import Scheduler, SchedulerConfig, SpeculativeConfig, Request, ModelRunnerOutput

assert not hasattr(dflash_rs._core, "_inject_fault"), "a release wheel must not carry the fault hook"
files = {p.name for p in res.files("dflash_rs").iterdir()}
assert {"_core.pyi", "py.typed", "kernels"} <= files, files
kernel_files = {p.name for p in (res.files("dflash_rs") / "kernels").iterdir()}
assert "__init__.py" in kernel_files and len(kernel_files) > 1, kernel_files
s = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=1008, speculative=SpeculativeConfig("dflash", 4)))
s.add_request(Request("a", list(range(40)), max_tokens=2))
while s.has_unfinished_requests():
    out = s.schedule()
    s.check_invariants()
    s.update_from_output(out, ModelRunnerOutput(out.req_ids, [[] if c else [1] for c in out.is_prefill_chunk]))
print(f"wheel ok: dflash_rs {dflash_rs.__version__} from {dflash_rs.__file__}; kernels: {sorted(kernel_files)}")
PY
