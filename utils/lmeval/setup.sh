#!/usr/bin/env bash
# Creates .venv-lmeval/ (at the repository root): EleutherAI's lm-eval with the pins of
# utils/lmeval/requirements.txt, a client apart from the project's own environment.
# Usage: bash utils/lmeval/setup.sh [PYTHON]   (default python3; a second run with the same pins does nothing)
exec bash "$(dirname "$0")/../client_venv.sh" lmeval lm_eval "$@"
