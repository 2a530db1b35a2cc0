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
import re
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


# Where a range of the tables (options.RANGES, parse.RANGES, parse.CHAT_RANGES) is checked: the
# functions that call ``Range.holds``. One check of the options' ranges (``validate``) and one per
# kind of request field (``_int``, ``_float``); ``valid_seed`` checks the library's ``seed_each``,
# seeds that are no option.
RANGE_CHECKS = {"request/options.py::GenerationOptions.validate", "request/options.py::valid_seed",
                "request/parse.py::_int", "request/parse.py::_float"}


def range_checks() -> set[str]:
    """``path::function`` of every call of ``.holds(`` in generation/."""
    found = set()
    for path in modules():
        tree = ast.parse(path.read_text(), str(path))
        for scope in ast.walk(tree):
            if isinstance(scope, ast.ClassDef):
                methods = [(f"{scope.name}.{f.name}", f) for f in scope.body if isinstance(f, ast.FunctionDef)]
            elif isinstance(scope, ast.Module):
                methods = [(f.name, f) for f in scope.body if isinstance(f, ast.FunctionDef)]
            else:
                continue
            for name, function in methods:
                if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "holds"
                       for n in ast.walk(function)):
                    found.add(f"{path.relative_to(PACKAGE)}::{name}")
    return found


def test_each_range_is_checked_in_one_place():
    assert range_checks() == RANGE_CHECKS
    # The server's body models document the ranges but check none (pydantic's ge/gt/le/lt).
    source = (PACKAGE / "serving" / "schema.py").read_text()
    assert not re.search(r"\b(ge|gt|le|lt)=", source), "a range checked by the schema"


@pytest.fixture
def validations(monkeypatch):
    """How many times ``GenerationOptions.validate`` runs (the one check of the options' ranges)."""
    calls = []
    original = GenerationOptions.validate

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(GenerationOptions, "validate", counted)
    return calls


def test_a_request_is_checked_once_and_made_into_options_in_one_step(validations):
    """A request-file line: read and checked once; its batch's options and the server's per-row
    options are made from the checked request, not checked again."""
    from generation.run.request_batch import RequestBatch
    from generation.serving.params import SamplingParams

    request = parse_request('{"prompt": "x", "temperature": 0.7, "top_p": 0.9, "seed": 3, "max_tokens": 5}', 1)
    assert len(validations) == 1
    options = RequestBatch([request], [[1]], 32, 4096).options()
    params = SamplingParams.of(request)
    assert len(validations) == 1
    assert (options.temperature, options.top_p, options.max_new_tokens, options.max_length) == (0.7, 0.9, 5, 32)
    assert (params.temperature, params.top_p, params.seed) == (0.7, 0.9, 3)


def test_a_server_body_is_checked_once(validations):
    from generation.serving.params import SamplingParams

    completion = parse_completion({"prompt": "x", "temperature": 0.5, "top_k": 4, "ignore_eos": True}, "m")
    params = SamplingParams.of(completion.request)
    assert len(validations) == 1
    assert (params.temperature, params.top_k, params.ignore_eos) == (0.5, 4, True)
