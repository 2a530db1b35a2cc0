"""Where a row's text ends (generation/search/text_ends.py): EOS, stop strings, and how much of an
unfinished row streaming may give out. No model: token ids of the test checkpoints' tokenizer (which
splits " four" in two)."""

from __future__ import annotations

import threading

import pytest
import torch

from generation.run.batch import BloomTokenizer
from generation.search.text_ends import TextEnd, first_stop, safe_length, text_end
from generation.run.streaming import _TokenWatcher

EOS = 2


@pytest.fixture(scope="module")
def tok(make_ckpt):
    return BloomTokenizer(make_ckpt())


@pytest.fixture(scope="module")
def words(tok):
    ids = tok.encode(" one two three four")
    assert [tok.decode([i]) for i in ids] == [" one", " two", " three", " f", "our"]
    return ids


def test_eos_ends_the_text_and_stays_in_the_ids(tok, words):
    ids = words[:2] + [EOS] + words[2:]
    assert text_end(ids, [], tok) == TextEnd(" one two", ids[:3], "eos")
    assert text_end(words, [], tok) == TextEnd(" one two three four", words, None)


def test_a_stop_string_after_eos_does_not_count(tok, words):
    ids = words[:1] + [EOS] + words[1:]
    assert text_end(ids, [" two"], tok) == TextEnd(" one", ids[:2], "eos")
    assert text_end(words[:2] + [EOS], [" two"], tok) == TextEnd(" one", words[:1], "stop")


def test_a_stop_spanning_two_tokens_keeps_the_token_it_starts_in(tok, words):
    end = text_end(words, ["ee f"], tok)  # "ee" ends ' three', " f" is the next token
    assert (end.text, end.reason) == (" one two thr", "stop")
    assert end.token_ids == words[:3]  # ' three' spells "thr"; ' f' is not needed


@pytest.mark.parametrize("stops", [[" t", " two"], [" two", " t"], [" two", " two three"]])
def test_a_stop_that_is_a_prefix_of_another_cuts_at_their_common_start(tok, words, stops):
    assert text_end(words, stops, tok) == TextEnd(" one", words[:1], "stop")


def test_a_stop_inside_another_ends_the_text_first():
    # "bc" is complete before "abcd" can be, so it wins, however far the text runs past it.
    text = "xabcdy"
    assert [first_stop(text[:n], ["abcd", "bc"]) for n in range(len(text) + 1)] == [None] * 4 + [2] * 3
    assert first_stop("abc", ["bc", "c"]) == 1  # completed together: the one that starts first


def test_hold_back_only_what_could_still_become_a_stop_string():
    assert safe_length("hello wor", ["world"]) == len("hello ")
    assert safe_length("hello wo", ["world", "wow"]) == len("hello ")
    assert safe_length("hello", ["world"]) == len("hello")  # "o" starts no stop string
    assert safe_length("hello wor", ["or"]) == len("hello w")  # complete: cut before it
    assert safe_length("", ["world"]) == 0
    assert safe_length("hello", []) == len("hello")


def test_hold_back_at_the_very_end():
    # A finished row (EOS, or its last token) can complete nothing: the held tail is given out.
    assert safe_length("hello wor", ["world"], finished=True) == len("hello wor")
    assert safe_length("hello world", ["world"], finished=True) == len("hello ")
    assert safe_length("wor", ["world"]) == 0


def stream_pieces(tok, ids: list[int], stops: list[str]) -> list[str]:
    """Streaming's loop hook fed one token per step (as on the CPU), then flushed as the loop ends."""
    pieces: list[str] = []
    watcher = _TokenWatcher(tok, stops, 1, pieces.append, threading.Event())
    for t in ids:
        watcher(torch.tensor([t]), torch.tensor([False]))
    watcher.flush()
    return pieces


@pytest.mark.parametrize("stops", [["ee f"], [" t", " two"], ["our", "f"], ["hree four", "e"], ["\u2603"]])
def test_streaming_gives_out_the_text_that_text_end_keeps(tok, words, stops):
    ids = words[:4] + [EOS] + words[4:]  # EOS after ' f': "our" is never text
    pieces = stream_pieces(tok, ids, stops)
    assert "".join(pieces) == text_end(ids, stops, tok).text


def test_streaming_holds_back_nothing_that_cannot_start_a_stop(tok, words):
    pieces = stream_pieces(tok, words, ["\u2603 snow"])
    assert pieces == [" one", " two", " three", " f", "our"]
    # "o" and "our" could still begin "ours": each waits until the next token says otherwise, and
    # the row's end (no EOS here) is left to the finished result.
    assert stream_pieces(tok, words, ["ours"]) == [" one", " tw", "o three", " f"]
