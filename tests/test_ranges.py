"""Every range of the request tables, generated from the tables (so a new option cannot be missed):
for each bound, the value just outside is refused naming the field and the bound itself is
accepted, through the server (HTTP), its body parser, the request-file parser and ``--options``.

The ranges come from ``request/options.py``'s ``RANGES`` (the generation options) and
``request/parse.py``'s ``RANGES`` and ``CHAT_RANGES`` (a request's own fields); the server's
schema states them (``documented_range``), and the cases here are made from that schema, after
checking that every table entry a body can set is in it.
"""

from __future__ import annotations

import http.client
import json

import pytest

from generation.request import options as option_table
from generation.request import parse as request_table
from generation.request.options import MAX_INT, GenerationOptions, OptionError, build_options
from generation.request.parse import RequestError, parse_request
from generation.serving.openai_format import ApiError, parse_chat, parse_completion
from generation.serving.schema import ChatBody, CompletionBody
from servers import tiny_server

KEY = "ranges-key"
CHAT = [{"role": "user", "content": "x"}]
# Each range is tried beside each of these: top_p, for one, is checked at temperature 0 as well.
CONTEXTS = [{}, {"temperature": 0}]
# Fields a body can set whose checks also read another field: the companions that let the bound
# itself be accepted (min_tokens <= max_tokens, max_tokens 0 only with echo, beams return n).
COMPANIONS = {"min_tokens": lambda v: {"max_tokens": min(max(v, 16), MAX_INT)},
              "max_tokens": lambda v: {"echo": True} if v == 0 else {},
              "num_beams": lambda v: {"temperature": 0}, "n": lambda v: {"best_of": v},
              "top_logprobs": lambda v: {"logprobs": True}}
# The server's only: a request file takes presence_penalty and frequency_penalty at 0 alone, and
# no ignore_eos or min_tokens (request/parse.SERVER_KEYS).
SERVER_ONLY = request_table.SERVER_KEYS


def bounded_fields(model) -> dict[str, dict]:
    """The body's fields whose schema states a range, with that range."""
    words = ("minimum", "maximum", "exclusiveMinimum")
    properties = model.model_json_schema()["properties"]
    return {name: {w: p[w] for w in words if w in p} for name, p in properties.items() if any(w in p for w in words)}


def cases(model) -> list[tuple[str, object, bool]]:
    """(field, value, accepted) at each bound: the bound (accepted unless exclusive) and the
    nearest value outside (an integer one step out, a float 1e-6 out)."""
    made = []
    for name, bounds in bounded_fields(model).items():
        integer = model.model_fields[name].annotation not in (float, float | None)
        step = 1 if integer else 1e-6
        if "minimum" in bounds:
            made += [(name, bounds["minimum"], True), (name, bounds["minimum"] - step, False)]
        if "exclusiveMinimum" in bounds:
            low = bounds["exclusiveMinimum"]
            made += [(name, low, False), (name, low + (1 if integer else 1e-3), True)]
        if "maximum" in bounds:
            made += [(name, bounds["maximum"], True), (name, bounds["maximum"] + step, False)]
    return made


COMPLETION_CASES = cases(CompletionBody)
CHAT_CASES = cases(ChatBody)


def body(name: str, value, context: dict, chat: bool = False) -> dict:
    made = {"messages": CHAT} if chat else {"prompt": "x"}
    companions = COMPANIONS.get(name, lambda v: {})(value)
    if chat:
        companions.pop("echo", None)  # (chat asks for at least one token: max_tokens 0 is out)
    return made | context | companions | {name: value}


def refusal(check) -> str:
    with pytest.raises((RequestError, OptionError, ApiError)) as error:
        check()
    return getattr(error.value, "message", None) or str(error.value)


def test_every_range_of_the_tables_is_in_the_schema():
    """What a body can set and a table bounds is a case here (through the schema's words)."""
    settable = (request_table.FORMAT_KEYS | request_table.SEARCH_OPTIONS | request_table.SERVER_KEYS)
    tables = {n for n in option_table.RANGES if n in settable} | set(request_table.RANGES)
    assert tables <= set(bounded_fields(CompletionBody)), tables - set(bounded_fields(CompletionBody))
    assert set(request_table.CHAT_RANGES) <= set(bounded_fields(ChatBody))
    assert {"top_p", "frequency_penalty", "presence_penalty", "temperature", "seed"} <= {c[0] for c in COMPLETION_CASES}


@pytest.mark.parametrize("context", CONTEXTS, ids=["default", "temperature0"])
@pytest.mark.parametrize("name, value, accepted", COMPLETION_CASES)
def test_completion_body_bounds(name, value, accepted, context):
    sent = body(name, value, context)
    if accepted:
        parse_completion(sent, "m")
    else:
        error = pytest.raises(ApiError, parse_completion, sent, "m").value
        assert error.param == name and name in error.message, error.message


@pytest.mark.parametrize("name, value, accepted", CHAT_CASES)
def test_chat_body_bounds(name, value, accepted):
    sent = body(name, value, {}, chat=True)
    if accepted:
        parse_chat(sent, "m", tokenizer=None)
    else:
        error = pytest.raises(ApiError, parse_chat, sent, "m", None).value
        assert error.param == name and name in error.message, error.message


@pytest.mark.parametrize("context", CONTEXTS, ids=["default", "temperature0"])
@pytest.mark.parametrize("name, value, accepted", [c for c in COMPLETION_CASES if c[0] not in SERVER_ONLY])
def test_request_file_line_bounds(name, value, accepted, context):
    line = json.dumps(body(name, value, context))
    if accepted:
        parse_request(line, 1)
    else:
        assert refusal(lambda: parse_request(line, 1)).startswith(name + " "), line


def option_cases() -> list[tuple[str, object, bool]]:
    made = []
    for name, allowed in option_table.RANGES.items():
        integer = option_table.OPTIONS_BY_NAME[name].type is int
        step = 1 if integer else 1e-6
        if allowed.low is not None:
            made += [(name, allowed.low, not allowed.low_open), (name, allowed.low - step, False)]
        high = allowed.high if allowed.high is not None else MAX_INT if integer and name != "seed" else None
        if high is not None:
            made += [(name, high, True), (name, high + step, False)]
    return made


@pytest.mark.parametrize("name, value, accepted", option_cases())
def test_options_bounds(name, value, accepted):
    """``--options`` (and the library's keywords): the same table."""
    companions = {"temperature": {"do_sample": True}, "num_return_sequences": {"do_sample": True},
                  "max_new_tokens": {"max_length": MAX_INT}}.get(name, {})
    if accepted:
        assert getattr(build_options(**companions, **{name: value}), name) == value
        assert getattr(GenerationOptions().updated(**companions, **{name: value}), name) == value
    else:
        assert refusal(lambda: build_options(**companions, **{name: value})).startswith(name + " ")


# --- through HTTP -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def port():
    with tiny_server(KEY, 64, 32) as (_, _, port):
        yield port


def post(port: int, path: str, sent: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(sent).encode(),
                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read() or b"{}")


def test_the_server_refuses_each_value_outside_naming_the_field(port):
    for path, chat, made in (("/v1/completions", False, COMPLETION_CASES), ("/v1/chat/completions", True, CHAT_CASES)):
        for name, value, accepted in made:
            if accepted:
                continue
            for context in CONTEXTS:
                status, answer = post(port, path, body(name, value, context, chat))
                assert status == 400 and answer["error"]["param"] == name, (path, name, value, answer)


def test_the_server_answers_at_each_bound_it_can_run(port):
    """A bound the engine can run within its max_length and vocabulary is answered; the others
    (max_tokens 2**31 - 1, num_beams past what the vocabulary allows) are refused for the model,
    naming the field, never for the range."""
    for path, chat, made in (("/v1/completions", False, COMPLETION_CASES), ("/v1/chat/completions", True, CHAT_CASES)):
        for name, value, accepted in made:
            if not accepted:
                continue
            sent = body(name, value, {}, chat) | ({"max_tokens": 2} if name not in ("max_tokens", "min_tokens",
                                                                                    "max_completion_tokens") else {})
            status, answer = post(port, path, sent)
            message = answer.get("error", {}).get("message", "")
            assert status == 200 or ("must be" not in message or "for this model" in message), (path, name, answer)
            assert status == 200 or answer["error"]["param"] in (name, "prompt", "max_tokens"), (path, name, answer)
