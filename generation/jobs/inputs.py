"""Reading prompts from files: a JSON list of strings, or plain text with one prompt per line."""

from __future__ import annotations

import json
from pathlib import Path

from ..batch import InputError


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from ``path``. A file whose first non-blank character is ``[`` must be a JSON list of
    strings; anything else is text, one prompt per non-blank line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"input file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read input file {path}: {error}") from None
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"input file {path} is not valid JSON (line {error.lineno}, column {error.colno}: "
                             f"{error.msg})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError(f"input file {path} must hold a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]
