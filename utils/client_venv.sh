#!/usr/bin/env bash
# Creates .venv-NAME/ (at the repository root) from the pins of utils/NAME/requirements.txt: an
# outside client (lm-eval, guidellm) in an environment apart from the project's own, whose pins
# those clients' dependencies would break.
# Usage: bash utils/client_venv.sh NAME COMMAND [PYTHON]
#   COMMAND: the client's executable in the venv's bin/ (its presence, with the same pins, means
#   there is nothing to do); PYTHON: the interpreter the venv is made from (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
name=$1 command=$2 python=${3:-python3}
venv=.venv-$name
pins=utils/$name/requirements.txt
if [ -x "$venv/bin/$command" ] && cmp -s "$pins" "$venv/installed-requirements.txt"; then
    echo "$name: $venv is up to date"
    exit 0
fi
start=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
# torch first: the CPU wheel 2.13.0 satisfies the client's needs, so pip keeps it and never pulls a CUDA build.
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -r "$pins"
cp "$pins" "$venv/installed-requirements.txt"
echo "$name: installed in $venv in $((SECONDS - start)) s"
