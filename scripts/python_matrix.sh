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

find_python() {  # prints a CPython $1 interpreter, or fails
    local root candidates exe
    root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
    # PATH first, then pyenv's builds, newest first. A pyenv shim answers for versions pyenv
    # has but has not selected, with an error: each candidate is asked its version.
    candidates=("$(command -v "python$1" 2>/dev/null || true)")
    mapfile -t -O 1 candidates < <(ls -d "$root"/versions/"$1".*/bin/python"$1" 2>/dev/null | sort -rV)
    for exe in "${candidates[@]}"; do
        if [[ -n $exe ]] && "$exe" -c "import sys; assert '%d.%d' % sys.version_info[:2] == '$1'" 2>/dev/null; then
            echo "$exe"
            return 0
        fi
    done
    echo "no CPython $1 here (PATH or pyenv); set DFLASH_RS_PYTHONS to the versions to test" >&2
    return 2
}

venv_for() {  # prints the venv of requirements-python-$1.txt, creating it if missing
    local reqs=requirements-python-$1.txt
    [[ -f $reqs ]] || { echo "no $reqs" >&2; return 2; }
    local python full pins key
    python=$(find_python "$1")
    full=$("$python" -c 'import platform; print(platform.python_version())')
    mapfile -t pins < <(grep -Ev '^\s*(#|$)' "$reqs")
    key=$(printf '%s\n' "$full" "${pins[@]}" | sha256sum | cut -c1-12)
    local cache=${DFLASH_RS_CACHE:-$HOME/.cache/dflash-rs}/venv-python-$1-$key
    if [[ ! -f $cache/.complete ]]; then
        echo "creating $cache (CPython $full) with ${pins[*]}" >&2
        rm -rf "$cache"
        mkdir -p "$(dirname "$cache")"
        "$python" -m venv "$cache"
        "$cache/bin/python" -m pip install -q "${pins[@]}" >&2
        touch "$cache/.complete"
    fi
    echo "$cache"
}

venvs=()
for v in "${versions[@]}"; do
    venv=$(venv_for "$v")
    stamp=$venv/.dflash-rs-wheel
    digest=$(sha256sum "$wheel" | cut -c1-64)
    if [[ ! -f $stamp || $(cat "$stamp") != "$digest" ]]; then
        "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$wheel"
        echo "$digest" >"$stamp"
    fi
    venvs+=("$venv")
done

# The tests and the project's pytest settings, outside the repository (no dflash_rs on the path;
# less --benchmark-disable: pytest-benchmark is not installed).
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
mkdir -p "$run/tests"
sed 's/ --benchmark-disable//' pyproject.toml >"$run/pyproject.toml"
cp tests/conftest.py "$run/tests/"
cp -r tests/support "$run/tests/"
for t in "${CORE_TESTS[@]}"; do
    mkdir -p "$run/$(dirname "$t")"
    cp -r "$t" "$run/$t"
done

run_one() {  # version venv: the core tests in that venv
    local about
    about=$("$2/bin/python" -c \
        'import platform, numpy, dflash_rs._core as c; print(f"CPython {platform.python_version()}, numpy {numpy.__version__}, in-place reads {c._fast_paths()}")')
    echo "== python $1: $about; wheel $(basename "$wheel")"
    cd "$run" && PYTHONPATH= "$2/bin/python" -m pytest -q "${CORE_TESTS[@]}"
}

pids=()
for i in "${!versions[@]}"; do
    run_one "${versions[$i]}" "${venvs[$i]}" >"$run/${versions[$i]}.log" 2>&1 &
    pids+=($!)
done
status=0
for i in "${!versions[@]}"; do
    wait "${pids[$i]}" || { status=1; echo "python ${versions[$i]}: FAILED" >&2; }
    tail -n 25 "$run/${versions[$i]}.log"
done
exit $status
