"""Structured output on the real server through the ``openai`` client: response_format
(json_object, json_schema) and vLLM's guided_* fields, completions and chat, streaming, n, greedy
and sampled, concurrent requests beside unconstrained ones; answers that finish validate against
their schema (``jsonschema``) or regex; a bad constraint is a 400 naming its field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from servers import tiny_server
from test_structured import BOUNDED, OPEN, REFUSED, REGEXES

MAX_LENGTH, WIDTH, KEY = 128, 32, "test-key"


@pytest.fixture(scope="module")
def server():
    with tiny_server(KEY, MAX_LENGTH, WIDTH) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[2]}/v1", api_key=KEY, max_retries=0, timeout=120)


def check_json(text: str, finish: str, schema: dict) -> None:
    if finish == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert schema not in BOUNDED, (text, finish)  # a bounded schema always finishes


def test_completions_under_schemas_greedy_and_sampled(client):
    for schema in BOUNDED + OPEN:
        for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 7, "n": 3}):
            out = client.completions.create(model="bloom-tiny", prompt="The record:", max_tokens=60,
                                            extra_body={"guided_json": schema}, **extra)
            for choice in out.choices:
                check_json(choice.text, choice.finish_reason, schema)


def test_chat_response_format(client):
    schema = BOUNDED[2]
    out = client.chat.completions.create(
        model="bloom-tiny", messages=[{"role": "user", "content": "Describe a person."}], max_tokens=80,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    check_json(out.choices[0].message.content, out.choices[0].finish_reason, schema)
    out = client.chat.completions.create(model="bloom-tiny", messages=[{"role": "user", "content": "JSON please"}],
                                         max_tokens=60, response_format={"type": "json_object"}, temperature=0)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_streaming_joins_to_a_valid_answer(client):
    schema = BOUNDED[1]
    pieces, finish = [], None
    for chunk in client.completions.create(model="bloom-tiny", prompt="Colour:", max_tokens=40, stream=True,
                                           temperature=0, extra_body={"guided_json": schema}):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    check_json("".join(pieces), finish, schema)
    assert finish == "stop"


def test_regex_choice_grammar(client):
    for regex in REGEXES:
        out = client.completions.create(model="bloom-tiny", prompt="Answer:", max_tokens=30, temperature=0.7, seed=3,
                                        n=2, extra_body={"guided_regex": regex})
        for choice in out.choices:
            if choice.finish_reason == "stop":
                assert re.fullmatch(regex, choice.text), choice.text
    out = client.completions.create(model="bloom-tiny", prompt="Mood:", max_tokens=8, temperature=0,
                                    extra_body={"guided_choice": ["happy", "sad"]})
    assert out.choices[0].text in ("happy", "sad") and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model="bloom-tiny", prompt="Sum:", max_tokens=20, temperature=0,
                                    extra_body={"guided_grammar": 'root ::= [0-9] " + " [0-9]'})
    assert re.fullmatch(r"[0-9] \+ [0-9]", out.choices[0].text)


def test_concurrent_constrained_and_free_requests(server, client):
    """Constrained rows share steps with unconstrained ones; the unconstrained answers are what
    each prompt gives alone, the constrained ones follow their schema."""
    generator = server[0]
    cases = [(i, BOUNDED[i % len(BOUNDED)] if i % 2 else None) for i in range(12)]

    def ask(case):
        i, schema = case
        extra = {"guided_json": schema} if schema else {}
        return client.completions.create(model="bloom-tiny", prompt=f"Item {i}:", max_tokens=30, temperature=0,
                                         extra_body=extra)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(ask, cases))
    for (i, schema), out in zip(cases, outs):
        if schema:
            check_json(out.choices[0].text, out.choices[0].finish_reason, schema)
        else:
            want = generator.generate([f"Item {i}:"], max_length=MAX_LENGTH, max_new_tokens=30, ignore_eos=False,
                                      bucket_width=WIDTH)[0].text
            assert out.choices[0].text == want


def test_greedy_server_equals_the_library(server, client):
    generator = server[0]
    schema = BOUNDED[2]
    out = client.completions.create(model="bloom-tiny", prompt="Person:", max_tokens=60, temperature=0,
                                    extra_body={"guided_json": schema})
    want = generator.generate(["Person:"], max_length=MAX_LENGTH, max_new_tokens=60, ignore_eos=False,
                              bucket_width=WIDTH, guided_json=schema)[0]
    assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("constraint", [
    {"guided_json": BOUNDED[2]}, {"guided_json": BOUNDED[1]}, {"guided_regex": REGEXES[0]},
    {"guided_choice": ["alpha", "beta gamma"]},
])
def test_the_grammars_end_ends_the_row_as_in_the_library(server, client, constraint):
    """The row ends with the token that completes its grammar: the server's tokens and usage are
    the library's (a row that missed the end would run one step more, to EOS, and count it)."""
    generator = server[0]
    for prompt in ("Person:", "The answer is"):
        want = generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=60, ignore_eos=False,
                                  bucket_width=WIDTH, **constraint)[0].sequences[0]
        assert want.finish_reason == "stop"
        out = client.completions.create(model="bloom-tiny", prompt=prompt, max_tokens=60, temperature=0, logprobs=0,
                                        extra_body=constraint)
        assert out.choices[0].text == want.text and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens == len(want.token_ids), (out.usage, want)
        assert len(out.choices[0].logprobs.tokens) == len(want.token_ids)


@pytest.mark.parametrize("field, value", [
    ("guided_json", "{nope"), ("guided_json", {"type": "nonsense"}), ("guided_regex", "(unclosed"),
    ("guided_choice", []), ("guided_grammar", "start: nowhere"), ("response_format", {"type": "xml"}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
    *(next(iter(fields.items())) for fields, _ in REFUSED),
])
def test_bad_constraints_are_a_400_naming_the_field(client, field, value):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="bloom-tiny", prompt="Hi", max_tokens=4, extra_body={field: value})
    assert error.value.body["param"] == field, error.value.body
    assert field in error.value.body["message"]
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="bloom-tiny", messages=messages, max_tokens=4, extra_body={field: value})
    assert error.value.body["param"] == field, error.value.body


def test_beams_and_two_constraints_are_refused(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="bloom-tiny", prompt="Hi", max_tokens=4, temperature=0,
                                  extra_body={"guided_regex": "a+", "num_beams": 2})
    assert "beam search" in error.value.body["message"]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="bloom-tiny", prompt="Hi", max_tokens=4,
                                  extra_body={"guided_regex": "a+", "guided_choice": ["a"]})
    assert "only one of" in error.value.body["message"]
    # The server still answers afterwards.
    assert client.completions.create(model="bloom-tiny", prompt="Hi", max_tokens=2).choices[0].text is not None
