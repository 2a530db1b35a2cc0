"""Reading prompts from files: a JSON list of strings, or plain text with one prompt per line."""

from __future__ import annotations

import json
from pathlib import Path

from ..run.batch import InputError
from .files import read_user_file


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from ``path``. A file whose first non-blank character is ``[`` must be a JSON list of
    strings; one that starts with ``{`` and parses as JSON is refused (a JSON object is not a list
    of prompts); anything else is text, one prompt per non-blank line. A byte-order mark is not
    part of the text."""
    path = Path(path)
    try:
        text = read_user_file(path, "input").decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise InputError(f"input file {path} is not UTF-8 text (byte {error.start + 1})") from None
    if text.lstrip().startswith("{"):
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            pass  # text that happens to start with a brace
        else:
            raise InputError(f"input file {path} holds a JSON object; it must be a JSON list of strings "
                             "or text with one prompt per line")
    if text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except RecursionError:
            raise InputError(f"input file {path} is nested too deeply to be a list of prompts") from None
        except json.JSONDecodeError as error:
            raise InputError(f"input file {path} is not valid JSON (line {error.lineno}, column {error.colno}: "
                             f"{error.msg})") from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError(f"input file {path} must hold a JSON list of strings")
        return prompts
    return [line for line in text.splitlines() if line.strip()]
