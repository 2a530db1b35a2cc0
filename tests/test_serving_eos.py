"""vLLM's ``ignore_eos`` and ``min_tokens`` in the server, on a checkpoint whose EOS is likely
(``eos_checkpoint``): on the embedded one no greedy row meets EOS within a test's few tokens, so a
server that ignored either field would pass every other serving test.

* ``ignore_eos``: a row runs to ``max_tokens`` past the EOS that would have ended it, with the
  tokens of transformers' ``generate`` with no EOS (``eos_token_id=None``); its text is theirs
  decoded with special tokens skipped, as vLLM gives it, its finish reason "length", and its usage
  counts every token. The same prompt without it stops at its EOS.
* ``min_tokens=k``: no row ends before k tokens: the tokens of transformers' ``generate`` with
  ``min_new_tokens=k``, where without it the row would have ended earlier.

Each through the engine directly and through the real HTTP server with the official ``openai``
client (``extra_body``, as vLLM's clients send these fields).
"""

from __future__ import annotations

import json

import pytest
import torch

from generation import Generator
from generation.serving.engine import Engine, EngineConfig
from generation.serving.params import SamplingParams
from servers import engine_server

EOS, PAD = 2, 3
MAX_LENGTH, WIDTH, NEW, KEY, MODEL = 64, 16, 16, "test-key", "bloom-eos"
# Greedy rows of eos_checkpoint that meet EOS within their first four tokens.
EARLY_EOS = ["It was the best of times", "with her is at to", "he and the a said is"]
# (prompt, k): greedy meets EOS before k tokens; with min_new_tokens=k it ends at a later EOS
# (the first three) or runs to max_tokens (the last).
MIN_TOKENS = [("with her is at to", 6), ("in a by", 4), ("it by and and to to", 4), ("he a it and was", 8)]


@pytest.fixture(scope="module")
def generator(eos_checkpoint):
    return Generator.from_pretrained(eos_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def hf_tokenizer(eos_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(eos_checkpoint)


def hf_greedy(eos_reference, ids: list[int], stop_at_eos: bool = True, **options) -> list[int]:
    """transformers' greedy tokens for one prompt: NEW of them, or up to its EOS (kept)."""
    with torch.no_grad():
        out = eos_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                                     eos_token_id=EOS if stop_at_eos else None, **options)
    return out[0, len(ids):].tolist()


def run(engine: Engine, submit) -> list:
    """``submit()``'s handles, answered by the scheduler's steps on this thread."""
    handles = submit()
    while engine.step() or engine.queue_length:
        pass
    return handles


@pytest.fixture(scope="module")
def engine(generator):
    engine = Engine(generator, EngineConfig(max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH))
    engine.warm_up()
    return engine


# --- the engine ---------------------------------------------------------------------------------


def test_ignore_eos_runs_past_eos_to_max_tokens_in_the_engine(generator, engine, eos_reference, hf_tokenizer):
    tok = generator.tokenizer
    # Each prompt with and without ignore_eos, in one batch.
    handles = run(engine, lambda: [(engine.submit(tok.encode(p), SamplingParams(max_tokens=NEW, ignore_eos=True)),
                                    engine.submit(tok.encode(p), SamplingParams(max_tokens=NEW)))
                                   for p in EARLY_EOS])
    for prompt, (ignoring, stopping) in zip(EARLY_EOS, handles):
        ids = tok.encode(prompt)
        want = hf_greedy(eos_reference, ids, stop_at_eos=False)
        assert EOS in want[:-1], prompt  # EOS would have ended it early
        events = list(ignoring.events(1))
        (sequence,) = [e.sequence for e in events if e.kind == "finish"]
        assert sequence.token_ids == want, prompt
        assert sequence.finish_reason == "length", prompt
        assert sequence.text == hf_tokenizer.decode(want, skip_special_tokens=True), prompt
        assert events[-1].usage["completion_tokens"] == NEW, prompt
        # What streamed is the whole answer.
        deltas = [e for e in events if e.kind == "delta"]
        assert [t for e in deltas for t in e.token_ids] == want, prompt
        assert "".join(e.text for e in deltas) == sequence.text, prompt
        # Without it the row ends at its EOS.
        (stopped,) = stopping.result(1)
        assert stopped.token_ids == hf_greedy(eos_reference, ids), prompt
        assert stopped.finish_reason == "eos" and len(stopped.token_ids) < NEW, prompt


def test_ignore_eos_when_sampling_draws_on_past_eos(generator, engine):
    """A seeded sample with ignore_eos is the sample without it (Generator.generate alone, the same
    seed) up to that one's EOS, then goes on to max_tokens."""
    tok = generator.tokenizer
    prompt, seed, options = EARLY_EOS[1], 4, dict(temperature=1.3, top_k=40)
    alone = generator.generate([prompt], max_length=MAX_LENGTH, max_new_tokens=NEW, ignore_eos=False,
                               bucket_width=WIDTH, do_sample=True, seed=seed, **options)[0]
    assert alone.finish_reason == "eos" and len(alone.token_ids) < NEW  # the seed meets EOS early
    (handle,) = run(engine, lambda: [engine.submit(tok.encode(prompt), SamplingParams(max_tokens=NEW, seed=seed,
                                                                                     ignore_eos=True, **options))])
    (sequence,) = handle.result(1)
    assert sequence.token_ids[: len(alone.token_ids)] == alone.token_ids
    assert len(sequence.token_ids) == NEW and sequence.finish_reason == "length"


def test_min_new_tokens_in_the_engine(generator, engine, eos_reference, hf_tokenizer):
    """min_tokens reaches the engine as the batch runner's min_new_tokens (its offline path)."""
    from generation.request.parse import parse_request

    tok = generator.tokenizer
    requests = [parse_request(json.dumps({"prompt": p, "max_tokens": NEW, "min_new_tokens": k, "temperature": 0}), i)
                for i, (p, k) in enumerate(MIN_TOKENS)]
    handles = run(engine, lambda: [engine.submit_offline(r, [tok.encode(p)]) for r, (p, _) in zip(requests, MIN_TOKENS)])
    for (prompt, k), handle in zip(MIN_TOKENS, handles):
        ids = tok.encode(prompt)
        want = hf_greedy(eos_reference, ids, min_new_tokens=k)
        assert len(hf_greedy(eos_reference, ids)) < k <= len(want), prompt  # without it: ended before k
        (record,) = [e.record for e in handle.events(1) if e.kind == "record"]
        (choice,) = record["choices"]
        assert choice["text"] == hf_tokenizer.decode(want, skip_special_tokens=True), prompt
        assert record["usage"]["completion_tokens"] == len(want), prompt
        assert choice["finish_reason"] == ("stop" if want[-1] == EOS else "length"), prompt


# --- the HTTP server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(generator):
    with engine_server(generator, MODEL, KEY, max_batch=8, max_length=MAX_LENGTH, bucket_width=WIDTH) as running:
        yield running.client()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_ignore_eos_over_http(client, generator, eos_reference, hf_tokenizer, stream):
    for prompt in EARLY_EOS:
        ids = generator.tokenizer.encode(prompt)
        want = hf_greedy(eos_reference, ids, stop_at_eos=False)
        stopping = hf_greedy(eos_reference, ids)
        for extra, tokens, reason in [({"ignore_eos": True}, want, "length"), ({}, stopping, "stop")]:
            text, finish, usage = completion(client, prompt, stream, extra)
            assert text == hf_tokenizer.decode(tokens, skip_special_tokens=True), (prompt, extra)
            assert finish == reason and usage.completion_tokens == len(tokens), (prompt, extra)
    # Chat takes it too.
    messages = [{"role": "user", "content": EARLY_EOS[0]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=NEW, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == NEW and chat.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_min_tokens_over_http(client, generator, eos_reference, hf_tokenizer, stream):
    for prompt, k in MIN_TOKENS:
        want = hf_greedy(eos_reference, generator.tokenizer.encode(prompt), min_new_tokens=k)
        text, finish, usage = completion(client, prompt, stream, {"min_tokens": k})
        assert text == hf_tokenizer.decode(want, skip_special_tokens=True), prompt
        assert usage.completion_tokens == len(want) >= k, prompt
        assert finish == ("stop" if want[-1] == EOS else "length"), prompt


def completion(client, prompt: str, stream: bool, extra: dict):
    """(text, finish_reason, usage) of one greedy completion, whole or streamed."""
    options = dict(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0, extra_body=extra)
    if not stream:
        r = client.completions.create(**options)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    return "".join(c.text for c in choices), choices[-1].finish_reason, chunks[-1].usage
