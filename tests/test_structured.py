"""Structured output through the library's ``Generator.generate`` (``generation/request/grammar.py``):
answers that finish validate against their JSON schema (the ``jsonschema`` package) or regex;
bounded schemas always finish; greedy tokens under a grammar equal transformers' ``generate`` with
a logits processor made of llguidance's own matcher on the same weights; bad constraints are
errors naming their field."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from generation.request.options import OptionError
from generation.request.grammar import GrammarError, grammar_from_fields

# Bounded: every string, number and array has a limit, so an answer always ends within the budget.
BOUNDED = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
     "required": ["name", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "integer", "enum": [1, 2, 3]}},
     "required": ["colour", "size"], "additionalProperties": False},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 6},
                                                    "age": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["first", "age"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
     "required": ["person", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
]
OPEN = [{"type": "object"}, {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}]
REGEXES = [r"[a-z]{2,6} [0-9]{1,3}", r"(yes|no), because [a-z ]{1,12}\.", r"-?[0-9]+(\.[0-9]{1,2})?"]
# Constraints the grammar library refuses, each with the field that must be named: refused while
# reading the field (schema false, a schema that is not JSON) or when compiled against the
# tokenizer (an unsatisfiable schema, a grammar with a missing rule). Every entry point (library,
# request file, server) gets each as an error naming the field.
REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "no", "schema": False}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "string", "minLength": 5, "maxLength": 2}}}}, "response_format"),
    ({"guided_json": "false"}, "guided_json"),
    ({"guided_json": {"type": "integer", "minimum": 5, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
]


@pytest.fixture(scope="module")
def generator(tiny_checkpoint):
    from generation.generator import Generator

    return Generator.from_pretrained(tiny_checkpoint)


def finished(sequence) -> bool:
    return sequence.finish_reason in ("stop", "eos")


@pytest.mark.parametrize("schema", BOUNDED + OPEN)
@pytest.mark.parametrize("sample", [None, 1, 2])
def test_json_answers_validate(generator, schema, sample):
    kwargs = dict(do_sample=True, seed=sample, num_return_sequences=2) if sample else {}
    results = generator.generate(["The record:", "Data", "{"], max_new_tokens=60, guided_json=schema, **kwargs)
    for result in results:
        for sequence in result.sequences:
            if schema in BOUNDED:
                assert sequence.finish_reason == "stop", sequence
            if finished(sequence):
                jsonschema.validate(json.loads(sequence.text), schema)
            else:  # cut by the budget: still a prefix the schema allows
                assert sequence.finish_reason == "length"


@pytest.mark.parametrize("speculate", [None, "ngram:4"])
def test_top_k_and_top_p_cut_among_the_tokens_the_grammar_allows(generator, speculate):
    """Sampling with top_k / top_p and a grammar: the mask comes first, so the head of the
    distribution is taken among the allowed tokens (taken first, it may hold none of them, and
    the row had nothing left to choose)."""
    for options in (dict(top_k=2), dict(top_p=0.05), dict(top_k=3, top_p=0.5, temperature=0.7)):
        results = generator.generate(["The record:", "Data"], max_new_tokens=60, guided_json=BOUNDED[1], do_sample=True,
                                     seed=3, num_return_sequences=3, speculate=speculate, **options)
        for sequence in (s for r in results for s in r.sequences):
            assert sequence.finish_reason == "stop", (options, sequence)
            jsonschema.validate(json.loads(sequence.text), BOUNDED[1])


@pytest.mark.parametrize("regex", REGEXES)
@pytest.mark.parametrize("sample", [None, 5])
def test_regex_answers_match(generator, regex, sample):
    kwargs = dict(do_sample=True, seed=sample) if sample else {}
    for result in generator.generate(["Answer:", "Well"], max_new_tokens=40, guided_regex=regex, **kwargs):
        sequence = result.sequences[0]
        if finished(sequence):
            assert re.fullmatch(regex, sequence.text), sequence.text


def test_choice_and_grammar_and_response_format(generator):
    choices = ["positive", "negative", "neutral"]
    for result in generator.generate(["I liked it.", "Awful!"], max_new_tokens=10, guided_choice=choices,
                                     do_sample=True, seed=0, num_return_sequences=3):
        assert all(s.text in choices and s.finish_reason == "stop" for s in result.sequences)
    lark = 'start: "(" num " " op " " num ")"\nnum: /[0-9]{1,3}/\nop: "+" | "-"'
    (result,) = generator.generate(["Sum:"], max_new_tokens=30, guided_grammar=lark)
    assert re.fullmatch(r"\([0-9]{1,3} [+-] [0-9]{1,3}\)", result.text), result.text
    gbnf = 'root ::= "ok" | "fail"'
    assert generator.generate(["Status:"], max_new_tokens=5, guided_grammar=gbnf)[0].text in ("ok", "fail")
    (result,) = generator.generate(["JSON:"], max_new_tokens=40, response_format={"type": "json_object"})
    assert isinstance(json.loads(result.text), dict)
    schema = BOUNDED[1]
    (result,) = generator.generate(["JSON:"], max_new_tokens=40,
                                   response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    jsonschema.validate(json.loads(result.text), schema)


def test_rows_with_and_without_constraints_share_a_call(generator):
    """A constrained row beside unconstrained ones: each row gives what it gives alone."""
    from generation.request.grammar import Grammar

    prompts = ["The record:", "Hello there", "Once upon"]
    grammar = grammar_from_fields(guided_json=BOUNDED[0])
    mixed = generator.generate(prompts, max_new_tokens=24, grammar_each=[None, grammar, None], ignore_eos=False)
    assert mixed[0].text == generator.generate(prompts[:1], max_new_tokens=24, ignore_eos=False)[0].text
    assert mixed[2].text == generator.generate(prompts[2:], max_new_tokens=24, ignore_eos=False)[0].text
    alone = generator.generate(prompts[1:2], max_new_tokens=24, guided_json=BOUNDED[0], ignore_eos=False)[0]
    assert mixed[1].sequences[0].token_ids == alone.sequences[0].token_ids
    jsonschema.validate(json.loads(mixed[1].text), BOUNDED[0])
    assert isinstance(grammar, Grammar)


class LLGuidanceReference:
    """A transformers logits processor made of llguidance's matcher alone (not our code): each
    row's allowed tokens from ``LLMatcher.compute_bitmask``, -inf elsewhere."""

    def __init__(self, grammar_text: str, tokenizer_json: str, vocab_size: int, eos: int):
        import llguidance

        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
        self.grammar, self.vocab_size, self.matchers = grammar_text, vocab_size, None

    def __call__(self, input_ids, scores):
        import llguidance

        if self.matchers is None:
            self.matchers = [llguidance.LLMatcher(self.tokenizer, self.grammar) for _ in range(input_ids.shape[0])]
        else:
            for matcher, token in zip(self.matchers, input_ids[:, -1].tolist()):
                matcher.consume_token(token)
        for row, matcher in enumerate(self.matchers):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            scores[row, torch.from_numpy(bits[: scores.shape[-1]] == 0)] = float("-inf")
        return scores


@pytest.mark.parametrize("constraint", [
    {"guided_json": BOUNDED[0]}, {"guided_json": BOUNDED[2]}, {"guided_regex": REGEXES[0]},
    {"guided_choice": ["alpha", "beta", "gamma delta"]},
])
def test_greedy_equals_transformers_with_llguidance(eos_checkpoint, eos_reference, eos_generator, constraint):
    import llguidance
    import transformers

    field, value = next(iter(constraint.items()))
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    if field == "guided_json":
        text = llguidance.LLMatcher.grammar_from_json_schema(value, defaults=layout)
    elif field == "guided_regex":
        text = llguidance.LLMatcher.grammar_from_regex(value)
    else:
        text = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    tokenizer_json = (eos_checkpoint / "tokenizer.json").read_text()
    vocab = eos_reference.config.vocab_size
    for prompt in ["Hello world", "The answer is", "a b c"]:
        ids = torch.tensor([eos_generator.tokenizer.encode(prompt)])
        processor = LLGuidanceReference(text, tokenizer_json, vocab, eos=2)
        out = eos_reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=40, do_sample=False,
                                     logits_processor=transformers.LogitsProcessorList([processor]),
                                     eos_token_id=2, pad_token_id=3)[0, ids.shape[1]:].tolist()
        (ours,) = eos_generator.generate([prompt], max_new_tokens=40, ignore_eos=False, **constraint)
        expected = out[: out.index(2)] if 2 in out and ours.sequences[0].finish_reason == "stop" else out
        expected = [t for t in expected if t != 3]
        assert ours.sequences[0].token_ids == expected, (prompt, ours.sequences[0], out)


@pytest.mark.parametrize("fields, field", [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "nonsense"}}, "guided_json"),
    ({"guided_json": 12}, "guided_json"),
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}}, "response_format"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_regex"),
    ({"guided_regex": "a" * 200_000}, "guided_regex"),
    *REFUSED,
])
def test_bad_constraints_name_their_field(generator, fields, field):
    with pytest.raises(GrammarError) as error:
        generator.generate(["x"], max_new_tokens=4, **fields)
    assert str(error.value).startswith(field + ":"), str(error.value)
    assert error.value.field == field


def test_beams_are_refused(generator):
    with pytest.raises(OptionError, match="not with beam search"):
        generator.generate(["x"], max_new_tokens=4, num_beams=2, guided_regex="[a-z]+")


def test_text_format_is_no_constraint():
    assert grammar_from_fields(response_format={"type": "text"}) is None
    assert grammar_from_fields() is None


def test_request_file_lines_with_constraints(generator, tmp_path):
    """Request-file lines carry the same fields; a bad constraint is that line's one error line,
    constrained and unconstrained lines share batches."""
    from generation.jobs.runner import run_requests

    lines = [
        {"prompt": "The record:", "max_tokens": 40, "temperature": 0, "guided_json": BOUNDED[0]},
        {"prompt": "Hello", "max_tokens": 8, "temperature": 0},
        {"prompt": "Answer:", "max_tokens": 20, "temperature": 0.8, "seed": 4, "n": 2, "guided_regex": REGEXES[0]},
        {"prompt": "Pick:", "max_tokens": 6, "temperature": 0, "guided_choice": ["x", "y"]},
        {"prompt": "Bad", "max_tokens": 6, "guided_json": "{nope"},
        {"prompt": "Bad", "max_tokens": 6, "guided_grammar": "start: nowhere"},
        {"prompt": "Beams", "max_tokens": 6, "num_beams": 2, "temperature": 0, "guided_regex": "a+"},
        {"prompt": "JSON:", "max_tokens": 30, "temperature": 0,
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": BOUNDED[1]}}},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = run_requests(generator, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    records = {lines.index(r["request"]) + 1: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    errors = {e["line"]: e for e in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())}
    assert sorted(errors) == [5, 6, 7] and summary.answered == 5
    assert "guided_json" in errors[5]["error"] and "guided_grammar" in errors[6]["error"]
    assert "beam search" in errors[7]["error"]
    text = lambda line, i=0: records[line]["result"]["choices"][i]["text"]  # noqa: E731
    jsonschema.validate(json.loads(text(1)), BOUNDED[0])
    assert all(re.fullmatch(REGEXES[0], text(3, i)) for i in range(2)
               if records[3]["result"]["choices"][i]["finish_reason"] == "stop")
    assert text(4) in ("x", "y")
    jsonschema.validate(json.loads(text(8)), BOUNDED[1])
    assert records[2]["result"]["choices"][0]["text"] == generator.generate(["Hello"], max_new_tokens=8,
                                                                             ignore_eos=False)[0].text


def test_refused_constraints_are_error_records_naming_the_field(tmp_path, capsys):
    """./bloom.py --requests: each refused constraint is its line's error record naming the field;
    the job goes on and answers the good line."""
    import bloom

    lines = [{"prompt": "Hi", "max_tokens": 4, **fields} for fields, _ in REFUSED] + [{"prompt": "Hi", "max_tokens": 4}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    bloom.main(["--quiet", "--requests", str(tmp_path / "in.jsonl"), "--results", str(tmp_path / "out.jsonl")])
    assert "Traceback" not in capsys.readouterr().err
    errors = {e["line"]: e["error"] for e in map(json.loads, (tmp_path / "out.jsonl.errors.jsonl").read_text().splitlines())}
    assert sorted(errors) == list(range(1, len(REFUSED) + 1))
    for line, (_, field) in enumerate(REFUSED, 1):
        assert errors[line].startswith(field + ":"), errors[line]
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


def test_cli_options(tmp_path):
    """--options: guided_json names a schema file; a bad constraint is one error line, exit 1."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "schema.json").write_text(json.dumps(BOUNDED[1]))

    def run(options: str):
        return subprocess.run([sys.executable, str(root / "bloom.py"), "--device", "cpu", "--max_length", "48",
                               "--quiet", "--options", options, "Hello"], capture_output=True, text=True, timeout=120)

    ok = run(f"guided_json={tmp_path / 'schema.json'},!ignore_eos")
    assert ok.returncode == 0, ok.stderr
    jsonschema.validate(json.loads(ok.stdout.strip()), BOUNDED[1])
    bad = run("guided_regex=[0-9")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: guided_regex:")


def test_vanilla_mode_refuses_structured_output_in_one_line(capsys):
    """transformers' generate (--mode vanilla) has no grammar: the field is refused, not ignored."""
    import bloom

    assert bloom.main(["--mode", "vanilla", "--options", "guided_choice=yes|no", "Is it?"]) == 1
    err = capsys.readouterr().err
    assert "error: guided_choice (structured output) runs in --mode optimized only" in err
    assert "Traceback" not in err
