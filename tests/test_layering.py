"""The package's layering, read from its imports (ast, lazy imports inside functions included), the
size of the server's functions, and the one range check of each request field.

``generation/`` is a library with applications over it:

- the library: ``generator``, ``request/`` (options, one request, grammars, checks), ``run/``
  (one batch: padding, results, log-probs, the prefix pool) and ``search/``, the loops they run;
- the applications: ``jobs/`` (request files, evaluation), ``serving/`` (engine and HTTP) and
  ``chat/`` (the shell).

Rules: the library imports no application (nothing imports upward), and no application imports
another (``serving/`` does not borrow from ``jobs/``: what both need lives in the library).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from generation.request.options import GenerationOptions, OptionError
from generation.request.parse import RequestError, parse_request
from generation.serving.openai_format import ApiError, parse_chat, parse_completion
from generation.serving.schema import ChatBody, CompletionBody

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "generation"
APPLICATIONS = {"jobs", "serving", "chat"}
MAX_FUNCTION_LINES = 80  # in serving/: a function longer than this does more than one thing
# Functions of serving/ still longer than MAX_FUNCTION_LINES, to be split (none today).
TOO_LONG_TODO: set[str] = set()


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def part_of(parts: tuple[str, ...]) -> str:
    """The application a module of generation/ belongs to, or "library"."""
    return parts[1] if len(parts) > 2 and parts[1] in APPLICATIONS else "library"


def imported(path: Path) -> list[tuple[int, tuple[str, ...]]]:
    """(line, dotted name split) of every module ``path`` imports, relative imports resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    if path.name == "__init__.py":
        package = path.relative_to(ROOT).parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, tuple(alias.name.split("."))) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            target = base + tuple(node.module.split(".")) if node.module else base
            if node.module:
                found.append((node.lineno, target))
            else:
                found += [(node.lineno, target + (alias.name,)) for alias in node.names]
    return found


def test_the_import_resolver_sees_relative_and_lazy_imports():
    # (a check of the checker: a rule it cannot see is a rule we have not checked)
    serving_app = PACKAGE / "serving" / "routes.py"
    targets = {t for _, t in imported(serving_app)}
    assert ("generation", "serving", "in_flight") in targets and ("generation", "run", "logprobs") in targets
    rows = PACKAGE / "serving" / "device_rows.py"
    assert ("generation", "run", "request_batch") in {t for _, t in imported(rows)}  # a lazy import inside a method


def test_nothing_imports_upward_and_no_application_imports_another():
    wrong = []
    for path in modules():
        parts = path.relative_to(ROOT).with_suffix("").parts
        here = part_of(parts)
        for line, target in imported(path):
            if target[0] != "generation":
                continue
            there = part_of(target)
            if there != "library" and there != here:
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({here}) imports {'.'.join(target)} ({there})")
    assert not wrong, "\n".join(wrong)


def test_no_function_of_the_server_is_longer_than_it_can_be_read():
    long = {}
    for path in sorted((PACKAGE / "serving").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}::{node.name}"] = lines
    assert set(long) <= TOO_LONG_TODO, long


# --- one range check per field ------------------------------------------------------------------


def refusal(check) -> str:
    with pytest.raises((RequestError, OptionError, ApiError)) as error:
        check()
    return getattr(error.value, "message", None) or str(error.value)


@pytest.mark.parametrize("name, value, option", [
    ("temperature", -1.0, {"do_sample": True}),
    ("temperature", 1e-6, {"do_sample": True}),
    ("top_p", 1.5, {}),
    ("top_k", -2, {}),
    ("repetition_penalty", 0.0, {}),
    ("seed", -3, {}),
])
def test_a_search_option_is_refused_alike_in_options_request_files_and_server_bodies(name, value, option):
    """The range lives in options.RANGES only: --options, a request line, a completion body and a
    chat body give the one message (the server's with the field named)."""
    want = refusal(lambda: GenerationOptions().updated(**option, **{name: value}))
    assert refusal(lambda: parse_request(f'{{"prompt": "x", "{name}": {value}}}', 1)) == want
    assert refusal(lambda: parse_completion({"prompt": "x", name: value}, "m")) == want
    chat = {"messages": [{"role": "user", "content": "x"}], name: value}
    assert refusal(lambda: parse_chat(chat, "m", tokenizer=None)) == want


def test_the_schema_documents_the_ranges_the_core_checks():
    completion = CompletionBody.model_json_schema()["properties"]
    chat = ChatBody.model_json_schema()["properties"]
    assert completion["top_p"]["exclusiveMinimum"] == 0 and completion["top_p"]["maximum"] == 1
    assert completion["n"]["maximum"] == 128 and completion["logprobs"]["maximum"] == 5
    assert completion["max_tokens"]["minimum"] == 0 and chat["max_tokens"]["minimum"] == 1
    assert completion["temperature"]["minimum"] == 0  # 0: greedy search
