"""LAMBADA-style evaluation: last-word accuracy and perplexity of passages, batched.

Input: JSONL, one ``{"text": ...}`` per line. Each passage is split before its last word:
context = everything up to the last space, target = the space and the last word (whitespace that
ends the context moves to the target, as lm-eval's ``_encode_pair`` moves it); the two are
tokenized separately and concatenated. lm-eval tokenizes context + target whole and cuts at the
context's token count instead: with BLOOM's pre-tokenizer, which splits before every space, the two
give the same tokens.

- **accuracy**: the share of passages whose greedy continuation of the context is exactly the
  target's tokens. It is computed teacher-forced from one pass: every target token must be the most
  likely token given the tokens before it, which is the same as greedy decoding producing them.
- **perplexity**: per token over whole passages: exp(total negative log-likelihood / number of
  predicted tokens), where every token of every passage except its first is predicted from the
  tokens before it (there is no BOS token to predict the first from).
- **last_word_perplexity**: the same over the target tokens only (per token).
- **last_word_perplexity_per_word**: exp(mean over passages of the whole last word's negative
  log-likelihood): per word, not per token. This is what EleutherAI's lm-eval reports as
  ``perplexity`` for its LAMBADA tasks (its ``perplexity`` aggregation: exp(-mean of the per-passage
  log-likelihoods)), and what docs/serving.md compares with lm-eval run against our server.

Passages run in batches of similar length, padded to a multiple of 64 tokens (static shapes)
under a token budget.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..run.batch import InputError
from ..run.logprobs import score_rows, static_length
from ..run.progress import Progress
from .files import read_user_file


@dataclass
class EvalResult:
    passages: int
    accuracy: float
    perplexity: float
    last_word_perplexity: float
    last_word_perplexity_per_word: float
    tokens: int  # predicted tokens (the perplexity's denominator)

    def to_dict(self) -> dict:
        return asdict(self)


def read_passages(path: str | Path) -> list[str]:
    """Texts of a ``{"text": ...}`` JSONL file; a bad line is an InputError naming it."""
    try:
        lines = read_user_file(path, "evaluation").decode("utf-8").split("\n")  # not splitlines: see runner.jsonl_lines
    except UnicodeDecodeError as error:
        raise InputError(f"cannot read evaluation file {path}: {error}") from None
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}: line {number}: not valid JSON ({error.msg})") from None
        except RecursionError:
            raise InputError(f"{path}: line {number}: nested too deeply") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(f'{path}: line {number}: expected an object with a "text" string')
        try:
            record["text"].encode("utf-8")
        except UnicodeEncodeError:  # JSON allows a lone surrogate ("\ud800"); no tokenizer does
            raise InputError(f"{path}: line {number}: the text holds a lone surrogate (not valid Unicode)") from None
        if " " not in record["text"].strip():
            raise InputError(f"{path}: line {number}: the text needs a context before its last word")
        texts.append(record["text"])
    if not texts:
        raise InputError(f"evaluation file {path} holds no passages")
    return texts


def split_last_word(text: str) -> tuple[str, str]:
    """'a b c' -> ('a b', ' c'); 'a  b' -> ('a', '  b') (the context ends without whitespace)."""
    text = text.rstrip()
    context = text[:text.rfind(" ")].rstrip()
    return context, text[len(context):]


def evaluate(generator, texts: list[str], budget: int = 8192, progress: bool = False) -> EvalResult:
    """The numbers of the module doc; ``progress``: passages done and their rate on stderr."""
    rows, targets = encode_passages(generator, texts)
    chunks = plan_chunks(rows, budget)
    scored = {}
    with Progress(len(rows), "eval", "passages", enabled=progress) as bar:
        for chunk in chunks:
            scored.update(score_chunk(generator, rows, targets, chunk))
            bar.update(len(chunk))
    return combine([scored[i] for chunk in chunks for i in chunk], len(rows))


def encode_passages(generator, texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Each passage's token ids (context then target) and its target's token count."""
    tok = generator.tokenizer
    rows, targets = [], []
    for text in texts:
        context, target = split_last_word(text)
        ctx_ids, tgt_ids = tok.encode(context), tok.encode(target)
        rows.append(ctx_ids + tgt_ids)
        targets.append(len(tgt_ids))
    return rows, targets


def plan_chunks(rows: list[list[int]], budget: int) -> list[list[int]]:
    """Passage indexes per pass: similar lengths together, as many rows as the budget allows."""
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    chunks, at = [], 0
    while at < len(order):
        end = at + 1
        while end < len(order) and (end - at + 1) * static_length(len(rows[order[end]])) <= budget:
            end += 1
        chunks.append(order[at:end])
        at = end
    return chunks


def score_chunk(generator, rows, targets, chunk: list[int]) -> dict[int, tuple[float, int, float, int, bool]]:
    """One pass: per passage, (sum of its log-probs, their count, sum over the target, the target's
    token count, whether greedy gives the target)."""
    length = static_length(max(len(rows[i]) for i in chunk))
    scored = score_rows(generator.runner, [rows[i] for i in chunk], 0, length, generator.tokenizer.pad_token_id)
    out = {}
    for i, scores in zip(chunk, scored):
        n_target = targets[i]
        out[i] = (sum(scores.token_logprobs), len(scores.token_logprobs), sum(scores.token_logprobs[-n_target:]),
                  n_target, all(scores.greedy[-n_target:]))
    return out


def combine(per_passage: list[tuple[float, int, float, int, bool]], passages: int) -> EvalResult:
    """The numbers from every passage's scores, summed in the order given (the order of the passes,
    so that a split run sums its floats exactly as one process does)."""
    nll, count, tgt_nll, tgt_count, correct = 0.0, 0, 0.0, 0, 0
    for total, n, target, n_target, right in per_passage:
        nll -= total
        count += n
        tgt_nll -= target
        tgt_count += n_target
        correct += right
    return EvalResult(passages, correct / passages, math.exp(nll / count), math.exp(tgt_nll / tgt_count),
                      math.exp(tgt_nll / passages), count)
