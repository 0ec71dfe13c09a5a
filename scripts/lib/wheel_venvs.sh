# Helpers shared by the scripts that test the release wheel in cached venvs
# (kernels_matrix.sh, python_matrix.sh, vllm_env.sh, vllm_cpu_env.sh). Source it from the
# repository root.

# find_python X.Y: prints a CPython X.Y interpreter (python X.Y on PATH, else pyenv's newest
# X.Y.* build), or fails.
find_python() {
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
    echo "no CPython $1 here (PATH or pyenv)" >&2
    return 2
}

# cached_venv NAME PYTHON KEY PIN...: prints the venv ${DFLASH_RS_CACHE:-~/.cache/dflash-rs}/
# venv-NAME-<hash of KEY and the pins>, created with PYTHON and the pins if missing (a half-built
# one is rebuilt). KEY, if not empty, is what else the venv depends on (an interpreter version).
cached_venv() {
    local name=$1 python=$2 key=$3
    shift 3
    local pins=("$@") hash
    if [[ -n $key ]]; then
        hash=$(printf '%s\n' "$key" "${pins[@]}" | sha256sum | cut -c1-12)
    else
        hash=$(printf '%s\n' "${pins[@]}" | sha256sum | cut -c1-12)
    fi
    local cache=${DFLASH_RS_CACHE:-$HOME/.cache/dflash-rs}/venv-$name-$hash
    if [[ ! -f $cache/.complete ]]; then
        echo "creating $cache ${key:+($key) }with ${pins[*]}" >&2
        rm -rf "$cache"
        mkdir -p "$(dirname "$cache")"
        "$python" -m venv "$cache"
        "$cache/bin/python" -m pip install -q "${pins[@]}" >&2
        touch "$cache/.complete"
    fi
    note_venv_use "$cache"
    echo "$cache"
}

# note_venv_use VENV: marks a cached venv used now (scripts/prune_cache.sh keeps those a CI run
# used and removes the rest).
note_venv_use() {
    touch "$1/.last-used"
}

# install_wheel VENV WHEEL: installs WHEEL without dependencies, unless that very file is in.
install_wheel() {
    local stamp=$1/.dflash-rs-wheel digest
    digest=$(sha256sum "$2" | cut -c1-64)
    if [[ ! -f $stamp || $(cat "$stamp") != "$digest" ]]; then
        "$1/bin/python" -m pip install -q --no-deps --force-reinstall "$2"
        echo "$digest" >"$stamp"
    fi
}

# copy_tests DEST TEST...: the tests, their shared helpers and the project's pytest settings in
# DEST, outside the repository (no dflash_rs on the path; less --benchmark-disable, since
# pytest-benchmark is not installed there).
copy_tests() {
    local dest=$1 t
    shift
    mkdir -p "$dest/tests"
    sed 's/ --benchmark-disable//' pyproject.toml >"$dest/pyproject.toml"
    cp tests/conftest.py "$dest/tests/"
    cp -r tests/support "$dest/tests/"
    for t in "$@"; do
        mkdir -p "$dest/$(dirname "$t")"
        cp -r "$t" "$dest/$t"
    done
}

# run_side_by_side LABEL FN LOGDIR NAME=VENV...: runs `FN NAME VENV` for every pair at once
# (one core each), then prints each one's output in order; fails if any failed.
run_side_by_side() {
    local label=$1 fn=$2 logs=$3 pair status=0 i
    shift 3
    local pairs=("$@") pids=()
    for pair in "${pairs[@]}"; do
        "$fn" "${pair%%=*}" "${pair#*=}" >"$logs/${pair%%=*}.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!pairs[@]}"; do
        wait "${pids[$i]}" || { status=1; echo "$label ${pairs[$i]%%=*}: FAILED" >&2; }
        cat "$logs/${pairs[$i]%%=*}.log"
    done
    return $status
}
