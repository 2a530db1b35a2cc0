"""LAMBADA-style evaluation against the same numbers computed with transformers."""

from __future__ import annotations

import json
import math
import pytest
import torch

import bloom
from generation.run.batch import InputError
from generation.jobs.evaluate import evaluate, read_passages, split_last_word

CONTEXTS = ["The cat sat on the mat and", "Hello world, my friend", "She walked into the", "A long time ago in",
            "Once upon a time there was a", "We went to the"]


def make_passages(hf, tokenizer) -> list[str]:
    """Half the passages end with transformers' own greedy next word (so accuracy is not 0), half
    with a word it would not pick."""
    texts = []
    for i, context in enumerate(CONTEXTS):
        ids = tokenizer.encode(context)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=3)
        words = tokenizer.decode(out[0, len(ids):].tolist()).split()
        texts.append(context + " " + (words[0] if i % 2 == 0 and words else "zebra"))
    return texts


def hf_numbers(hf, tokenizer, texts):
    """Accuracy by literal greedy generation with transformers, perplexities from its logits: per
    token over passages, per token over last words, per last word (lm-eval's LAMBADA perplexity)."""
    correct, nll, count, tgt_nll, tgt_count = 0, 0.0, 0, 0.0, 0
    for text in texts:
        context, target = split_last_word(text)
        ctx, tgt = tokenizer.encode(context), tokenizer.encode(target)
        with torch.no_grad():
            out = hf.generate(torch.tensor([ctx]), max_new_tokens=len(tgt), do_sample=False, eos_token_id=None,
                              pad_token_id=3)
            logp = torch.log_softmax(hf(torch.tensor([ctx + tgt])).logits[0].float(), dim=-1)
        correct += out[0, len(ctx):].tolist() == tgt
        token_lp = logp[:-1].gather(-1, torch.tensor(ctx + tgt)[1:, None])[:, 0]
        nll -= token_lp.sum().item()
        count += len(token_lp)
        tgt_nll -= token_lp[-len(tgt):].sum().item()
        tgt_count += len(tgt)
    return (correct / len(texts), math.exp(nll / count), math.exp(tgt_nll / tgt_count),
            math.exp(tgt_nll / len(texts)))


def tgt_tokens(gen, texts) -> int:
    return sum(len(gen.tokenizer.encode(split_last_word(t)[1])) for t in texts)


def test_split_last_word_as_lm_eval_splits():
    """lm-eval's lambada: context = the words but the last joined by spaces, target = a space and
    the last word; whitespace ending the context moves to the target (its _encode_pair)."""
    assert split_last_word("a b c") == ("a b", " c")
    assert split_last_word("a b\n\nc d\n") == ("a b\n\nc", " d")
    assert split_last_word("a b.\n\nc") == ("a", " b.\n\nc")
    assert split_last_word("a \n b") == ("a", " \n b")
    assert split_last_word("a  b") == ("a", "  b")


@pytest.fixture(scope="module")
def passages(scoring_setup):
    """(texts, transformers' accuracy, perplexity, last-word perplexity per token and per word)."""
    _, gen, hf = scoring_setup
    texts = make_passages(hf, gen.tokenizer)
    return (texts, *hf_numbers(hf, gen.tokenizer, texts))


@pytest.mark.parametrize("budget", [64, 100000])  # one passage per batch, and all in one batch
def test_eval_matches_transformers(scoring_setup, passages, budget):
    _, gen, _ = scoring_setup
    texts, accuracy, ppl, word_ppl, per_word = passages
    assert 0 < accuracy < 1
    result = evaluate(gen, texts, budget=budget)
    assert result.passages == len(texts)
    assert result.accuracy == accuracy
    assert result.perplexity == pytest.approx(ppl, rel=1e-4)
    assert result.last_word_perplexity == pytest.approx(word_ppl, rel=1e-4)
    assert result.last_word_perplexity_per_word == pytest.approx(per_word, rel=1e-4)
    assert tgt_tokens(gen, texts) > len(texts)  # some last word has several tokens: per word != per token


def test_eval_cli_and_bad_files(scoring_setup, passages, tmp_path, capsys):
    folder = scoring_setup[0]
    texts, accuracy, ppl, _, per_word = passages
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "eval.json"
    args = ["--weights", str(folder), "--eval"]
    assert bloom.main(args + [str(data), "--results", str(out)]) == 0
    printed = capsys.readouterr()
    numbers = json.loads(out.read_text())
    assert numbers["accuracy"] == accuracy and numbers["perplexity"] == pytest.approx(ppl, rel=1e-4)
    assert numbers["last_word_perplexity_per_word"] == pytest.approx(per_word, rel=1e-4)
    assert f"accuracy: {accuracy:.4f}" in printed.out

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine text"}\n{"txt": "no text key"}\n')
    with pytest.raises(InputError, match="line 2"):
        read_passages(bad)
    assert bloom.main(args + [str(bad)]) == 1
    assert "line 2" in capsys.readouterr().err
