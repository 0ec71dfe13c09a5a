#!/usr/bin/env bash
# Removes the cached venvs that a run did not use, so that venvs left behind by changed pins
# (5-10 GB each) do not pile up on the disk that CI shares with them.
#
#   scripts/prune_cache.sh MARKER
#
# Every script that uses a venv in ${DFLASH_RS_CACHE:-~/.cache/dflash-rs} touches its
# .last-used (scripts/lib/wheel_venvs.sh: note_venv_use). This removes each venv-* there whose
# .last-used is not newer than the file MARKER (made when the run began), and says what it
# removed. `.ci/run` calls it after a green `make test`, which uses every venv the pins name.
set -euo pipefail
marker=${1:?usage: scripts/prune_cache.sh MARKER}
[[ -e $marker ]] || { echo "no marker file $marker" >&2; exit 2; }
cache=${DFLASH_RS_CACHE:-$HOME/.cache/dflash-rs}
shopt -s nullglob
for venv in "$cache"/venv-*/; do
    venv=${venv%/}
    if [[ ! $venv/.last-used -nt $marker ]]; then
        echo "removing $venv ($(du -sh "$venv" | cut -f1)), unused by this run"
        rm -rf "$venv"
    fi
done
