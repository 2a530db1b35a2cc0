"""The outside clients that live in virtual environments of their own (``utils/client_venv.sh``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def client_or_skip(name: str, command: str, required_by: str) -> Path:
    """``.venv-NAME/bin/COMMAND`` (made by ``bash utils/NAME/setup.sh``). Without it the test is
    skipped, or fails where the environment variable ``required_by`` is ``required`` (as in CI)."""
    path = ROOT / f".venv-{name}" / "bin" / command
    if not path.exists():
        reason = f"{name}'s virtual environment is absent ({path}): run bash utils/{name}/setup.sh"
        if os.environ.get(required_by) == "required":
            pytest.fail(f"{reason} ({required_by}=required)")
        pytest.skip(reason)
    return path
