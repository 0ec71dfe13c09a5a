#!/usr/bin/env bash
# Bounded coverage-guided fuzzing of dflash-core (cargo-fuzz + libFuzzer). See docs/FUZZING.md.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]      (default 30)
#
# Runs every target in rust/fuzz (or those in $FUZZ_TARGETS, space separated) for the given time,
# one after the other, seeded from the committed corpus rust/fuzz/corpus/<target>/. New corpus
# entries go to a temporary directory ($FUZZ_CORPUS_OUT/<target> if set, to keep them), so the
# work tree stays clean. Crash artifacts go to $FUZZ_ARTIFACTS (default rust/fuzz/artifacts,
# git-ignored) and are listed at the end. Exits non-zero if any target crashed.
#
# Other environment:
#   DFLASH_FUZZ_ALLOW  known findings to tolerate (comma separated, or all-known); default none.
#   FUZZ_ARGS          extra libFuzzer flags, e.g. "-max_len=8192".
#
# Works on the stable toolchain pinned in rust-toolchain.toml (no nightly): the targets are built
# with `--sanitizer none`, and then cargo-fuzz passes no -Z flag (only stable -C options for the
# SanitizerCoverage instrumentation and `--cfg fuzzing`), so RUSTC_BOOTSTRAP is not needed. The
# sanitizers (ASan, ...) would need nightly; the core has no unsafe code, so they add little.
set -euo pipefail

CARGO_FUZZ_VERSION=0.13.2
SECONDS_PER_TARGET=${1:-30}
if ! [[ $SECONDS_PER_TARGET =~ ^[0-9]+$ ]] || [ "$SECONDS_PER_TARGET" -lt 1 ]; then
    echo "usage: $0 [SECONDS_PER_TARGET]" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
ROOT=$(pwd)
FUZZ_DIR=rust/fuzz
ARTIFACTS=${FUZZ_ARTIFACTS:-$ROOT/$FUZZ_DIR/artifacts}
start=$(date +%s)

if [ "$(cargo fuzz --version 2>/dev/null || true)" != "cargo-fuzz $CARGO_FUZZ_VERSION" ]; then
    echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION"
    cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
fi
echo "== $(cargo --version), $(cargo fuzz --version)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
touch "$tmp/stamp"

TARGETS=${FUZZ_TARGETS:-$(cargo fuzz list --fuzz-dir "$FUZZ_DIR")}
echo "== building fuzz targets: $(echo $TARGETS)"
build_start=$(date +%s)
for t in $TARGETS; do
    if ! cargo fuzz build --fuzz-dir "$FUZZ_DIR" --sanitizer none "$t" >>"$tmp/build.log" 2>&1; then
        cat "$tmp/build.log"
        echo "== build of $t failed" >&2
        exit 1
    fi
done
grep -v -E '^\s*(Compiling|Downloaded|Downloading) ' "$tmp/build.log" || true
echo "== built in $(( $(date +%s) - build_start )) s"

failed=()
summary=()
for t in $TARGETS; do
    seeds="$ROOT/$FUZZ_DIR/corpus/$t"
    out=${FUZZ_CORPUS_OUT:+$FUZZ_CORPUS_OUT/$t}
    out=${out:-$tmp/corpus/$t}
    mkdir -p "$out" "$ARTIFACTS/$t"
    log="$tmp/$t.log"
    echo "== fuzzing $t for $SECONDS_PER_TARGET s (seeds: $FUZZ_DIR/corpus/$t, new corpus: $out)"
    set +e
    # The first corpus directory receives new inputs; the committed seeds are only read.
    # shellcheck disable=SC2086
    cargo fuzz run --fuzz-dir "$FUZZ_DIR" --sanitizer none "$t" "$out" "$seeds" -- \
        -max_total_time="$SECONDS_PER_TARGET" -timeout=30 -rss_limit_mb=2048 -max_len=4096 \
        -print_final_stats=1 -artifact_prefix="$ARTIFACTS/$t/" ${FUZZ_ARGS:-} >"$log" 2>&1
    rc=$?
    set -e
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    if [ $rc -ne 0 ] && grep -q 'failed to build fuzz script' "$log"; then
        failed+=("$t")
        echo "== $t: BUILD FAILED (exit $rc); log tail:"
        tail -40 "$log"
        summary+=("$t: build failed")
    elif [ $rc -ne 0 ]; then
        failed+=("$t")
        echo "== $t CRASHED (exit $rc):"
        grep -m1 -A3 -E 'panicked at|ERROR: libFuzzer' "$log" || tail -20 "$log"
        grep -E '^#[0-9]+[[:space:]]+(NEW|REDUCE|pulse|INITED)' "$log" | tail -1 || true
        grep -E 'Test unit written to' "$log" || true
        summary+=("$t: CRASH (artifacts in $ARTIFACTS/$t/)")
    else
        echo "== $t: $done_line"
        runs=$(grep -E '^stat::number_of_executed_units:' "$log" | awk '{print $2}')
        summary+=("$t: ok, ${runs:-?} execs, ${done_line#*DONE }")
    fi
done

echo "== summary (${SECONDS_PER_TARGET} s per target, $(( $(date +%s) - start )) s in all)"
for line in "${summary[@]}"; do
    echo "   $line"
done
if [ ${#failed[@]} -ne 0 ]; then
    echo "== crash artifacts:"
    for t in "${failed[@]}"; do
        find "$ARTIFACTS/$t" -type f -newer "$tmp/stamp" | sed 's|^|   |'
    done
    echo "== reproduce: cargo fuzz run --fuzz-dir $FUZZ_DIR --sanitizer none <target> <artifact>"
    echo "== decode:    (cd $FUZZ_DIR && FUZZ_TARGET=<target> FUZZ_INPUT=<artifact> cargo test --release explain -- --ignored --nocapture)"
    exit 1
fi
