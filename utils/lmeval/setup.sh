#!/usr/bin/env bash
# Creates .venv-lmeval/ (at the repository root): EleutherAI's lm-eval with the pins of
# utils/lmeval/requirements.txt, a client apart from the project's own environment.
# Usage: bash utils/lmeval/setup.sh [PYTHON]   (default python3; a second run with the same pins does nothing)
set -euo pipefail
cd "$(dirname "$0")/../.."
python=${1:-python3}
venv=.venv-lmeval
pins=utils/lmeval/requirements.txt
if [ -x "$venv/bin/lm_eval" ] && cmp -s "$pins" "$venv/installed-requirements.txt"; then
    echo "lm-eval: $venv is up to date"
    exit 0
fi
start=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
# torch first: the CPU wheel 2.13.0 satisfies lm-eval's needs, so pip keeps it and never pulls a CUDA build.
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -r "$pins"
cp "$pins" "$venv/installed-requirements.txt"
echo "lm-eval: $("$venv/bin/pip" show lm-eval | sed -n 's/^Version: //p') installed in $venv in $((SECONDS - start)) s"
