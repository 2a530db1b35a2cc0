"""Streaming: pieces as they are produced, joining to transformers' greedy text."""

from __future__ import annotations

import torch

import bloom
from generation.run.streaming import stream_text

PROMPT = "The cat sat on the mat and then"


def hf_text(hf, tokenizer, prompt, max_length):
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_length=max_length, do_sample=False, eos_token_id=None,
                          pad_token_id=3)
    return tokenizer.decode(out[0, len(ids):].tolist())


def test_stream_pieces_join_to_transformers_text(scoring_setup):
    _, gen, hf = scoring_setup
    pieces = list(gen.stream(PROMPT, max_length=32))
    assert "".join(pieces) == hf_text(hf, gen.tokenizer, PROMPT, 32)
    assert len(pieces) > 5  # it really came piece by piece, not as one block


def test_stream_copies_tokens_every_k_steps_and_respects_stop(scoring_setup):
    _, gen, hf = scoring_setup
    text = hf_text(hf, gen.tokenizer, PROMPT, 40)
    # copy_every=4 is the accelerator setting: one host copy per 4 steps, so at most
    # ceil(steps / 4) pieces come before the final one.
    steps = 40 - len(gen.tokenizer.encode(PROMPT))
    pieces = list(stream_text(gen, PROMPT, gen.options(max_length=40), copy_every=4))
    assert "".join(pieces) == text
    assert len(pieces) <= -(-steps // 4) + 1
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    pieces = list(gen.stream(PROMPT, max_length=40, stop=stop))
    assert "".join(pieces) == text[: text.find(stop)]
    assert stop not in "".join(pieces)


def test_breaking_out_of_the_stream_ends_generation(scoring_setup):
    _, gen, _ = scoring_setup
    stream = gen.stream(PROMPT, max_length=64)
    first = next(stream)
    stream.close()  # joins the worker thread; a hang here would fail the test by timeout
    assert first
    # The generator is usable again afterwards.
    assert gen.generate(PROMPT, max_length=24)[0].text


def test_cli_stream_prints_prompt_and_continuation(scoring_setup, capsys):
    folder, gen, hf = scoring_setup
    assert bloom.main(["--weights", str(folder), "--max_length", "24", "--stream", PROMPT]) == 0
    assert capsys.readouterr().out == PROMPT + hf_text(hf, gen.tokenizer, PROMPT, 24) + "\n"


def test_generate_streaming_on_the_calling_thread_and_its_cancel(scoring_setup):
    import threading

    from generation.run.streaming import generate_streaming

    _, gen, hf = scoring_setup
    want = hf_text(hf, gen.tokenizer, PROMPT, 40)
    pieces = []
    result = generate_streaming(gen, PROMPT, gen.options(max_length=40), pieces.append)
    assert "".join(pieces) == result.text == want and len(pieces) > 5
    # Cancelled after the third piece: the loop stops at its next step, what was given is a prefix.
    pieces, cancel = [], threading.Event()

    def emit(piece):
        pieces.append(piece)
        if len(pieces) == 3:
            cancel.set()

    assert generate_streaming(gen, PROMPT, gen.options(max_length=40), emit, cancelled=cancel) is None
    assert len(pieces) == 3 and want.startswith("".join(pieces))
