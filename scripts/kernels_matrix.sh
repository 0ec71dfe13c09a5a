#!/usr/bin/env bash
# The kernels' tested dependency range: the kernel tests on the oldest and the newest torch,
# triton and numpy the `kernels` extra allows (requirements-kernels-<name>.txt), each in a
# cached venv, with a dflash-rs wheel installed without dependencies, under TRITON_INTERPRET=1.
#
#   scripts/kernels_matrix.sh [--wheel PATH] [NAME...]     (default NAMEs: oldest newest)
#
# (a) Creates the venv if missing, with the pins of requirements-kernels-<NAME>.txt plus the
#     pytest and hypothesis pins of requirements-dev.txt. It lives in a cache keyed by those
#     pins, ${DFLASH_RS_CACHE:-~/.cache/dflash-rs}/venv-kernels-<NAME>-<hash>, so CI and fresh
#     clones on the same machine download them once.
# (b) Installs the wheel with --no-deps: --wheel PATH, else the newest dist/dflash_rs-*-abi3-*.whl
#     (skipped when that very file is already installed).
# (c) Runs the tests that import torch or triton (KERNEL_TESTS) on the wheel as built: no source
#     overlay, and from a copy outside the repository, so `import dflash_rs` is the wheel's. The
#     venvs' runs go side by side; each one's output is printed when it is done.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

KERNEL_TESTS=(tests/kernels)

wheel=""
if [[ ${1:-} == --wheel ]]; then
    wheel=$(realpath "$2")
    shift 2
fi
names=("$@")
[[ ${#names[@]} -gt 0 ]] || names=(oldest newest)
if [[ -z $wheel ]]; then
    wheel=$(ls -t "$repo"/dist/dflash_rs-*-abi3-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -z $wheel || ! -f $wheel ]]; then
    echo "no dflash-rs wheel found: run 'make wheel' or pass --wheel PATH" >&2
    exit 2
fi

source scripts/lib/wheel_venvs.sh

pin() { grep -E "^$1==" requirements-dev.txt; }

venv_for() {  # prints the venv of requirements-kernels-$1.txt, creating it if missing
    local reqs=requirements-kernels-$1.txt
    [[ -f $reqs ]] || { echo "no $reqs" >&2; return 2; }
    local pins
    mapfile -t pins < <(grep -Ev '^\s*(#|$)' "$reqs"; pin pytest; pin hypothesis)
    cached_venv "kernels-$1" python3 "" "${pins[@]}"
}

# Venvs are set up one at a time (downloads), then the test runs go side by side (one core each).
pairs=()
for name in "${names[@]}"; do
    venv=$(venv_for "$name")
    install_wheel "$venv" "$wheel"
    pairs+=("$name=$venv")
done

run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
copy_tests "$run" "${KERNEL_TESTS[@]}"

run_one() {  # name venv: the kernel tests in that venv
    local versions
    versions=$("$2/bin/python" -c \
        'import numpy, torch, triton; print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}")')
    echo "== kernels $1: $versions; wheel $(basename "$wheel")"
    cd "$run" && TRITON_INTERPRET=1 PYTHONPATH= "$2/bin/python" -m pytest -q \
        "${KERNEL_TESTS[@]}"
}

run_side_by_side kernels run_one "$run" "${pairs[@]}"
