#!/usr/bin/env bash
# The abi3 wheel on the CPythons it declares (pyproject: requires-python >= 3.9, numpy >= 1.24):
# the core's test suite (scheduler, KV manager, reliability, CLI; no torch, no vLLM) in one
# cached venv per requirements-python-<X.Y>.txt, each on CPython X.Y, the wheel installed
# without dependencies. 3.9 holds the oldest numpy allowed; 3.12 is the first CPython whose
# ints carry `lv_tag` (the wheel reads one-digit ints in place, `_core._fast_paths()`) and whose
# collector never runs inside a call that executes no bytecode; 3.13 is the newest.
#
#   scripts/python_matrix.sh [--wheel PATH] [X.Y...]     (default: every requirements-python-*.txt)
#
# (a) Finds CPython X.Y: python3.Y on PATH, else pyenv's newest X.Y.* build. A missing one is an
#     error (set DFLASH_RS_PYTHONS="3.12 3.13" to choose the versions on a machine without some).
# (b) Creates the venv if missing, keyed by the interpreter's full version and the pins, in
#     ${DFLASH_RS_CACHE:-~/.cache/dflash-rs}/venv-python-<X.Y>-<hash>.
# (c) Runs the tests from a copy outside the repository with the project's pytest settings, so
#     `import dflash_rs` is the wheel's. The runs go side by side; each output is printed when done.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "$0")/.."
repo=$PWD

CORE_TESTS=(tests/scheduler tests/kv tests/reliability tests/test_cli_arguments.py tests/test_error_classes.py)

wheel=""
if [[ ${1:-} == --wheel ]]; then
    wheel=$(realpath "$2")
    shift 2
fi
versions=("$@")
if [[ ${#versions[@]} -eq 0 && -n ${DFLASH_RS_PYTHONS:-} ]]; then
    read -ra versions <<<"$DFLASH_RS_PYTHONS"
fi
if [[ ${#versions[@]} -eq 0 ]]; then
    for f in requirements-python-*.txt; do
        v=${f#requirements-python-}
        versions+=("${v%.txt}")
    done
fi
if [[ -z $wheel ]]; then
    wheel=$(ls -t "$repo"/dist/dflash_rs-*-abi3-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -z $wheel || ! -f $wheel ]]; then
    echo "no dflash-rs wheel found: run 'make wheel' or pass --wheel PATH" >&2
    exit 2
fi
source scripts/lib/wheel_venvs.sh

venv_for() {  # prints the venv of requirements-python-$1.txt, creating it if missing
    local reqs=requirements-python-$1.txt
    [[ -f $reqs ]] || { echo "no $reqs" >&2; return 2; }
    local python full pins
    python=$(find_python "$1")
    full=$("$python" -c 'import platform; print(platform.python_version())')
    mapfile -t pins < <(grep -Ev '^\s*(#|$)' "$reqs")
    cached_venv "python-$1" "$python" "$full" "${pins[@]}"
}

pairs=()
for v in "${versions[@]}"; do
    venv=$(venv_for "$v")
    install_wheel "$venv" "$wheel"
    pairs+=("$v=$venv")
done

run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
copy_tests "$run" "${CORE_TESTS[@]}"

run_one() {  # version venv: the core tests in that venv
    local about
    about=$("$2/bin/python" -c \
        'import platform, numpy, dflash_rs._core as c; print(f"CPython {platform.python_version()}, numpy {numpy.__version__}, in-place reads {c._fast_paths()}")')
    echo "== python $1: $about; wheel $(basename "$wheel")"
    cd "$run" && PYTHONPATH= "$2/bin/python" -m pytest -q "${CORE_TESTS[@]}"
}

run_side_by_side python run_one "$run" "${pairs[@]}"
