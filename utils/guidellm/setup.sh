#!/usr/bin/env bash
# Creates .venv-guidellm/ (at the repository root): the guidellm load generator with the pins of
# utils/guidellm/requirements.txt, a client apart from the project's own environment.
# Usage: bash utils/guidellm/setup.sh [PYTHON]   (default python3; a second run with the same pins does nothing)
exec bash "$(dirname "$0")/../client_venv.sh" guidellm guidellm "$@"
