"""Stop strings against transformers' greedy output: the text ends before the first stop string."""

from __future__ import annotations

import pytest
import torch

from generation.run.results import make_sequence
from generation.search.stopping import StopError, stops_per_prompt
from generation.search.token_loop import EOS_CHECK_EVERY

PROMPTS = ["Hello world", "The cat sat on the mat and then"]
MAX_LENGTH = 32


def hf_greedy(hf, tokenizer, prompt: str, max_length: int = MAX_LENGTH) -> tuple[list[int], str]:
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_length=max_length, do_sample=False, num_beams=1,
                          eos_token_id=None, pad_token_id=3)[0, len(ids):].tolist()
    return out, tokenizer.decode(out)


def test_stop_string_cuts_text_like_transformers_output(scoring_setup):
    _, gen, hf = scoring_setup
    full = [hf_greedy(hf, gen.tokenizer, p) for p in PROMPTS]
    # Per prompt, a stop string taken from the middle of transformers' continuation.
    stops = [[text[len(text) // 2 : len(text) // 2 + 3]] for _, text in full]
    results = gen.generate(PROMPTS, max_length=MAX_LENGTH, stop=stops, logprobs=True)
    for (ids, text), stop, r in zip(full, stops, results):
        cut = text.find(stop[0])
        assert 0 <= cut <= len(text) // 2
        assert r.text == text[:cut]
        assert stop[0] not in r.text
        assert r.finish_reason == "stop"
        # The kept tokens are transformers' tokens, and just enough of them to spell the text.
        assert r.token_ids == ids[: len(r.token_ids)]
        assert gen.tokenizer.decode(r.token_ids).startswith(r.text)
        assert len(gen.tokenizer.decode(r.token_ids[:-1])) < cut or not r.token_ids
        assert len(r.sequences[0].token_logprobs) == len(r.token_ids)


def test_no_stop_hit_keeps_the_whole_text_and_length_reason(scoring_setup):
    _, gen, hf = scoring_setup
    _, text = hf_greedy(hf, gen.tokenizer, PROMPTS[0])
    r = gen.generate(PROMPTS[0], max_length=MAX_LENGTH, stop=["\u2603 never"])[0]
    assert r.text == text and r.finish_reason == "length"


def test_loop_ends_early_once_every_row_has_stopped(scoring_setup):
    _, gen, hf = scoring_setup
    _, text = hf_greedy(hf, gen.tokenizer, PROMPTS[1], max_length=96)
    steps = []
    r = gen.generate(PROMPTS[1], max_length=96, stop=text[:2], on_step=lambda tokens, done: steps.append(1))[0]
    assert r.text == "" and r.finish_reason == "stop"
    # The stop shows in the first tokens; the host checks every EOS_CHECK_EVERY steps.
    assert len(steps) == EOS_CHECK_EVERY


def test_cut_at_stop_picks_the_earliest_of_several(scoring_setup):
    _, gen, _ = scoring_setup
    ids = gen.tokenizer.encode(" one two three four")
    out = make_sequence(gen.tokenizer, ids, "length", stops=["four", " two"])
    assert out.text == " one" and out.finish_reason == "stop"
    assert gen.tokenizer.decode(out.token_ids).startswith(" one")


@pytest.mark.parametrize("bad", [3, [""], ["a", 1], {"a": 1}])
def test_bad_stop_values_are_rejected(bad):
    with pytest.raises(StopError):
        stops_per_prompt(bad, 1)
