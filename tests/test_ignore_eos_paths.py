"""``ignore_eos`` through each request path, with beams on the EOS-prone checkpoint
(``eos_checkpoint``), against transformers' ``generate`` on the same weights.

A request file line cannot set ``ignore_eos`` (its rows stop at EOS); a server body may, for greedy
search and sampling, while its beams (the batch runner's path) stop at EOS. Greedy text is cut at
EOS by the text layer whatever the search did, so only beams, whose hypotheses end at EOS or not,
and usage show whether the request's ``ignore_eos`` reached the search.
"""

from __future__ import annotations

import json

import openai
import pytest
import torch

from generation.serving.app import make_app
from generation.serving.engine import Engine, EngineConfig
from generation.serving.openai_format import TURN_STOPS
from servers import app_in_thread

EOS, PAD = 2, 3
MAX_LENGTH, KEY = 48, "eos-key"
PROMPTS = ["It was the best of times", "The quick brown fox jumps over", "Hello, world", "a"]


def hf_beams(reference, tokenizer, prompt: str, max_tokens: int, beams: int, returned: int,
             ignore_eos: bool) -> list[tuple[str, int, str]]:
    """transformers' best ``returned`` hypotheses: (text, tokens counted as usage, OpenAI's finish
    reason); a hypothesis that ended at EOS counts its EOS, and its text stops before it."""
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, num_beams=beams, num_return_sequences=returned,
                                 do_sample=False, pad_token_id=PAD, eos_token_id=None if ignore_eos else EOS)
    answers = []
    for row in out[:, len(ids):].tolist():
        ended = not ignore_eos and EOS in row
        tokens = row[: row.index(EOS) + 1] if ended else row
        answers.append((tokenizer.decode(tokens[:-1] if ended else tokens), len(tokens), "stop" if ended else "length"))
    return answers


def hf_greedy_ignoring_eos(reference, tokenizer, prompt: str, max_tokens: int) -> str:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=max_tokens, do_sample=False, pad_token_id=PAD, eos_token_id=None)
    return tokenizer.decode(out[0, len(ids):].tolist())


def test_the_comparisons_see_eos(eos_generator, eos_reference):
    """Meaningful only if some of the hypotheses below end at EOS and others run to the budget."""
    reasons = [a[2] for p in PROMPTS for a in hf_beams(eos_reference, eos_generator.tokenizer, p, 12, 4, 2, False)]
    assert "stop" in reasons and "length" in reasons


def test_request_file_beams_stop_at_eos(eos_generator, eos_reference, tmp_path):
    """A request line's rows stop at EOS (a line has no ignore_eos): its beams are transformers'
    with EOS, and its usage counts what they generated, not max_tokens."""
    from generation.jobs.runner import run_requests

    lines = [{"prompt": p, "max_tokens": 12, "temperature": 0, "num_beams": 4, "n": 2} for p in PROMPTS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_requests(eos_generator, tmp_path / "in.jsonl", tmp_path / "out.jsonl", progress=False)
    records = {r["request"]["prompt"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert len(records) == len(PROMPTS)
    for prompt in PROMPTS:
        want = hf_beams(eos_reference, eos_generator.tokenizer, prompt, 12, 4, 2, ignore_eos=False)
        choices = records[prompt]["result"]["choices"]
        assert [(c["text"], c["finish_reason"]) for c in choices] == [(t, f) for t, _, f in want], prompt
        assert records[prompt]["result"]["usage"]["completion_tokens"] == sum(n for _, n, _ in want), prompt


def test_an_ignore_eos_line_is_refused_naming_the_field():
    from generation.request.parse import RequestError, parse_request

    with pytest.raises(RequestError, match="'ignore_eos'"):
        parse_request('{"prompt": "x", "ignore_eos": true}', 1)


@pytest.fixture(scope="module")
def server(eos_generator):
    engine = Engine(eos_generator, EngineConfig(max_batch=4, max_length=MAX_LENGTH, bucket_width=16))
    with app_in_thread(engine, make_app(engine, "eos", KEY)) as port:
        yield port


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_server_beams_stop_at_eos(client, eos_generator, eos_reference):
    """A body with beams (answered on the batch runner's path) leaves ignore_eos off: transformers'
    hypotheses with EOS, and the usage they count."""
    for prompt in PROMPTS[:3]:
        out = client.completions.create(model="eos", prompt=prompt, max_tokens=12, temperature=0, n=2,
                                        extra_body={"num_beams": 4})
        want = hf_beams(eos_reference, eos_generator.tokenizer, prompt, 12, 4, 2, ignore_eos=False)
        assert [(c.text, c.finish_reason) for c in out.choices] == [(t, f) for t, _, f in want], prompt
        assert out.usage.completion_tokens == sum(n for _, n, _ in want), prompt


def test_server_chat_beams_stop_at_eos(client, eos_generator, eos_reference):
    """("a": its best beam without EOS starts elsewhere than its best beam with EOS.)"""
    for content in ("Hello", "a"):
        out = client.chat.completions.create(model="eos", messages=[{"role": "user", "content": content}],
                                             max_tokens=12, extra_body={"use_beam_search": True})
        ((text, _, reason),) = hf_beams(eos_reference, eos_generator.tokenizer, f"User: {content}\nAssistant:", 12,
                                        2, 1, ignore_eos=False)
        for stop in TURN_STOPS:
            if stop in text:
                text, reason = text.split(stop)[0], "stop"
        assert (out.choices[0].message.content, out.choices[0].finish_reason) == (text, reason), content


def test_server_ignore_eos_runs_greedy_rows_past_eos_and_refuses_beams(client, eos_generator, eos_reference):
    for prompt in PROMPTS:
        out = client.completions.create(model="eos", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == hf_greedy_ignoring_eos(eos_reference, eos_generator.tokenizer, prompt, 12)
        assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="eos", prompt="Hi", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True, "num_beams": 2})
    assert error.value.body["param"] == "ignore_eos"
