#!/usr/bin/env bash
# The vLLM drop-in's test environment: a separate venv with vLLM (PyPI's build; CPU is enough
# for the scheduler-level tests) and a dflash-rs wheel installed without dependencies.
#
#   VLLM_VERSION=0.33.0 scripts/vllm_env.sh [--wheel PATH] [test|python|setup] [ARGS...]
#   VLLM_PYTHON=3.12 scripts/vllm_env.sh ...   (another CPython: its own venv)
#
#   test    (default) pytest ARGS (tests/vllm unless ARGS name a path)
#   python  run the venv's python with ARGS (e.g. benches/vllm_dropin.py ...)
#   setup   only create the venv and install the wheel
#
# (a) Creates the venv if missing, with vllm==$VLLM_VERSION (default 0.33.0; 0.32.0 for the
#     older supported series) and the pytest, hypothesis and pytest-benchmark pins of
#     requirements-dev.txt. It lives in a cache keyed by those pins,
#     ${DFLASH_RS_CACHE:-~/.cache/dflash-rs}/venv-vllm-<version>-<hash>, so fresh clones on the
#     same machine (CI) reuse it; $VENV_VLLM links to it (default .venv-vllm for the newest
#     series, which the benchmarks use, .venv-vllm-<major.minor> for older ones).
#     $VLLM_PYTHON=X.Y picks CPython X.Y (on PATH or in pyenv) instead of python3: its full
#     version joins the key, and "-py<X.Y>" the default link.
# (b) Installs the wheel with --no-deps: --wheel PATH, else the newest
#     dist/dflash_rs-*-abi3-*.whl or .wheelhouse/dflash_rs-*-abi3-*.whl (skipped when that
#     very file is already installed).
# (c) Runs the command. By default the repository's pure-Python sources win over the wheel's:
#     PYTHONPATH points at a temporary copy of python/dflash_rs holding the wheel's compiled
#     _core, so a wheel from an older commit still tests the current Python code (its Rust API
#     must be compatible). DFLASH_RS_NO_OVERLAY=1 tests the installed wheel exactly as built
#     (CI, after `make wheel`); DFLASH_RS_CORE=path/to/_core.abi3.so puts another build of the
#     extension in the overlay.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=${VLLM_VERSION:-0.33.0}
series=$(cut -d. -f1,2 <<<"$VLLM_VERSION")
if [[ $series == 0.33 ]]; then default_venv=.venv-vllm; else default_venv=.venv-vllm-$series; fi
interpreter=python3
interpreter_key=()
source scripts/lib/wheel_venvs.sh
if [[ -n ${VLLM_PYTHON:-} ]]; then
    interpreter=$(find_python "$VLLM_PYTHON")
    full=$("$interpreter" -c 'import platform; print(platform.python_version())')
    interpreter_key=("python==$full")
    default_venv=$default_venv-py$(cut -d. -f1,2 <<<"$full")
fi
VENV_VLLM=${VENV_VLLM:-$default_venv}
PY="$VENV_VLLM/bin/python"

wheel=""
if [[ ${1:-} == --wheel ]]; then
    wheel=$2
    shift 2
fi
cmd=${1:-test}
[[ $# -gt 0 ]] && shift

pin() { grep -E "^$1==" requirements-dev.txt; }

pins=("vllm==$VLLM_VERSION" "$(pin pytest)" "$(pin hypothesis)" "$(pin pytest-benchmark)")
key=$(printf '%s\n' "${pins[@]}" "${interpreter_key[@]}" | sha256sum | cut -c1-12)
cache=${DFLASH_RS_CACHE:-$HOME/.cache/dflash-rs}/venv-vllm-$VLLM_VERSION-$key
if [[ ! -f $cache/.complete ]]; then
    echo "creating $cache with vllm==$VLLM_VERSION (several minutes, ~9 GB)" >&2
    rm -rf "$cache"
    mkdir -p "$(dirname "$cache")"
    "$interpreter" -m venv "$cache"
    "$cache/bin/python" -m pip install -q "${pins[@]}"
    touch "$cache/.complete"
fi
note_venv_use "$cache"
if [[ $(readlink "$VENV_VLLM" 2>/dev/null) != "$cache" ]]; then
    [[ -L $VENV_VLLM || ! -e $VENV_VLLM ]] || { echo "$VENV_VLLM is not a link: remove it" >&2; exit 2; }
    ln -sfn "$cache" "$VENV_VLLM"
fi

if [[ -z $wheel ]]; then
    wheel=$(ls -t dist/dflash_rs-*-abi3-*.whl .wheelhouse/dflash_rs-*-abi3-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -z $wheel || ! -f $wheel ]]; then
    echo "no dflash-rs wheel found: run 'make wheel' or pass --wheel PATH" >&2
    exit 2
fi
stamp="$VENV_VLLM/.dflash-rs-wheel"
digest=$(sha256sum "$wheel" | cut -c1-64)
if [[ ! -f $stamp || $(cat "$stamp") != "$digest" ]]; then
    "$PY" -m pip install -q --no-deps --force-reinstall "$wheel"
    echo "$digest" >"$stamp"
fi
echo "dflash-rs wheel: $wheel" >&2

if [[ -z ${DFLASH_RS_NO_OVERLAY:-} ]]; then
    overlay=$(mktemp -d)
    trap 'rm -rf "$overlay"' EXIT
    core=$("$PY" - <<'PY'
import glob, importlib.util, os
spec = importlib.util.find_spec("dflash_rs")
print(glob.glob(os.path.join(os.path.dirname(spec.origin), "_core*.so"))[0])
PY
)
    cp -r python/dflash_rs "$overlay/"
    find "$overlay" -name __pycache__ -prune -exec rm -rf {} +
    rm -f "$overlay"/dflash_rs/_core*.so
    cp "${DFLASH_RS_CORE:-$core}" "$overlay/dflash_rs/$(basename "$core")"
    export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
fi

case $cmd in
    setup) ;;
    test)
        paths=()
        for a in "$@"; do [[ -e ${a%%::*} ]] && paths+=("$a"); done
        if [[ ${#paths[@]} -eq 0 ]]; then set -- "$@" tests/vllm; fi
        "$PY" -m pytest "$@"
        ;;
    python) "$PY" "$@" ;;
    *)
        echo "unknown command $cmd (expected test, python or setup)" >&2
        exit 2
        ;;
esac
