"""Answering requests with ``Generator.generate``: a batch of requests that share their search
options, its rows, the scoring pass for log-probs and ``best_of``, and the result records.

A request's record is ``{"request": <the request as read>, "result": {"choices", "usage",
"request_time"}}``; the batch runner writes it as a line, and the server's offline path sends its
``result``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .logprobs import RowScores, TokenText, clip_pieces, offsets_of, score_rows
from ..request.options import GenerationOptions
from ..request.parse import Request
from .results import Sequence


@dataclass
class RequestBatch:
    """Requests answered by one generate call: same search options, one static length."""

    requests: list[Request]
    prompt_lengths: list[list[int]]  # tokens of each request's prompts
    length: int  # static prompt + new tokens length of the batch (a multiple of SHAPE_MULTIPLE)
    budget: int  # the token budget it was planned under

    @property
    def rows(self) -> int:
        return sum(len(r.prompts) * r.rows_per_prompt for r in self.requests)

    @property
    def max_tokens(self) -> int:
        """The largest budget of the batch: its static length makes room for it."""
        return max(r.max_tokens for r in self.requests)

    def options(self) -> GenerationOptions:
        extra = {"max_new_tokens": self.max_tokens} if self.max_tokens else {}
        return self.requests[0].to_options(max_length=self.length, **extra)

    def seeds(self) -> list[int | None]:
        """Each prompt's seed (None: the request gave none), in the order of its prompts."""
        return [r.options.seed for r in self.requests for _ in r.prompts]


# --- result records -----------------------------------------------------------------------------

OPENAI_FINISH = {"length": "length", "eos": "stop", "stop": "stop"}


@dataclass
class Choice:
    """One answer to one prompt, before it becomes JSON."""

    prompt: str
    prompt_ids: list[int]
    sequence: Sequence | None  # None when max_tokens is 0 (echo only)
    scores: RowScores | None  # scores of prompt + sequence tokens, when logprobs are asked


def choice_record(index: int, choice: Choice, request: Request, text_of: TokenText) -> dict:
    seq = choice.sequence
    gen_ids = seq.token_ids if seq is not None else []
    completion = seq.text if seq is not None else ""
    text = choice.prompt + completion if request.echo else completion
    record = {"text": text, "index": index, "logprobs": None,
              "finish_reason": OPENAI_FINISH[seq.finish_reason] if seq is not None else "length"}
    if request.logprobs is None:
        return record
    n_prompt = len(choice.prompt_ids)
    shown = (choice.prompt_ids if request.echo else []) + gen_ids
    first = 0 if request.echo else n_prompt  # index in prompt + generated tokens of shown[0]
    pieces = clip_pieces(text_of.pieces(shown), len(text))
    token_logprobs, top_logprobs = [], []
    for t, token_id in enumerate(shown, start=first):
        if t == 0:  # the first prompt token has no context to be scored from
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        at = t - choice.scores.first  # where token t's score sits
        chosen = choice.scores.token_logprobs[at]
        alternatives = zip(choice.scores.top_ids[at][: request.logprobs], choice.scores.top_logprobs[at])
        top = {}
        for alt_id, alt_lp in alternatives:
            top[text_of.label(alt_id)] = alt_lp
        top.setdefault(text_of.label(token_id), chosen)  # the chosen token is always listed
        token_logprobs.append(chosen)
        top_logprobs.append(top)
    record["logprobs"] = {"tokens": pieces, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                          "text_offset": offsets_of(pieces)}
    return record


def result_record(request: Request, choices: list[dict], usage: dict, batch_time: float, batch_size: int) -> dict:
    return {"request": request.raw,
            "result": {"choices": choices, "usage": usage,
                       "request_time": {"batch_time": batch_time, "batch_size": batch_size}}}


# --- answering ----------------------------------------------------------------------------------


def answer_batch(generator, batch: RequestBatch) -> tuple[list[dict], int]:
    """Records of every request of the batch (input order within the batch) and the number of
    completion tokens they hold."""
    start = time.perf_counter()
    requests = batch.requests
    prompts = [p for r in requests for p in r.prompts]
    owner = [r for r in requests for _ in r.prompts]
    prompt_ids, candidates, cached = _candidates(generator, batch, prompts, owner)
    scores = _scores(generator, batch, owner, prompt_ids, candidates)
    text_of = TokenText(generator.tokenizer)
    per_request: dict[int, list[dict]] = {id(r): [] for r in requests}
    usage = {id(r): [0, 0, 0] for r in requests}
    for i, (request, ids, seqs) in enumerate(zip(owner, prompt_ids, candidates)):
        picks = _pick(request, seqs, [scores.get((i, j)) for j in range(len(seqs))], len(ids))
        choices = per_request[id(request)]
        for seq, score in picks:
            choice = Choice(prompts[i], ids, seq, score)
            choices.append(choice_record(len(choices), choice, request, text_of))
            usage[id(request)][1] += len(seq.token_ids) if seq is not None else 0
        usage[id(request)][0] += len(ids)
        usage[id(request)][2] += cached[i]
    seconds = time.perf_counter() - start
    records, tokens = [], 0
    for r in requests:
        p, c, cached_tokens = usage[id(r)]
        tokens += c
        counts = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
        if generator.runner.prefix is not None:  # as OpenAI reports its own prompt caching
            counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
        records.append(result_record(r, per_request[id(r)], counts, seconds, len(prompts)))
    return records, tokens


def _candidates(generator, batch: RequestBatch, prompts: list[str], owner: list[Request]) -> tuple[list, list, list]:
    """Each prompt's token ids, its generated candidates (``[None]`` when nothing is generated)
    and the prompt tokens the prefix cache served."""
    if batch.requests[0].max_tokens > 0:
        # Filler rows (copies of the last prompt, dropped after) round the batch up to a standard
        # size, so that a group's short last batch replays a graph already captured.
        fill = standard_size(batch, len(prompts)) - len(prompts)
        stops = [r.stop for r in owner] + [owner[-1].stop] * fill
        budgets = [r.max_tokens for r in owner] + [owner[-1].max_tokens] * fill
        seeds = batch.seeds()
        seeds += seeds[-1:] * fill
        # Each prompt its request's structured output, if any (rows with and without share the batch).
        grammars = [r.grammar for r in owner] + [owner[-1].grammar] * fill
        results = generator.generate(prompts + [prompts[-1]] * fill, batch.options(), stop=stops,
                                     max_new_tokens_each=budgets, seed_each=seeds, grammar_each=grammars)[: len(prompts)]
        return ([res.prompt_token_ids for res in results], [res.sequences for res in results],
                [res.cached_tokens for res in results])
    # echo with max_tokens 0: score the prompt, generate nothing
    given = [ids for r in batch.requests for ids in (r.prompt_ids or [None] * len(r.prompts))]
    prompt_ids = [ids if ids is not None else encoded
                  for ids, encoded in zip(given, generator.tokenizer.encode_batch(prompts))]
    return prompt_ids, [[None] for _ in prompts], [0] * len(prompts)


def _scores(generator, batch: RequestBatch, owner: list[Request], prompt_ids: list, candidates: list) -> dict:
    """One scoring pass over every candidate that needs log-probs (asked for, or to rank
    best_of): (prompt index, candidate index) -> its RowScores."""
    needs = [r.logprobs is not None or (r.sampling and r.best_of > r.n) for r in owner]
    rows, where, wanted = [], [], []
    for i, (ids, seqs) in enumerate(zip(prompt_ids, candidates)):
        if needs[i]:
            for j, seq in enumerate(seqs):
                rows.append(list(ids) + (seq.token_ids if seq is not None else []))
                where.append((i, j))
                # echo shows the prompt's scores too; otherwise those of the generated tokens alone
                wanted.append(1 if owner[i].echo else len(ids))
    if not rows:
        return {}
    top_k = max((r.logprobs or 0) for r in owner)
    length = max(batch.length, max(len(r) for r in rows))
    return dict(zip(where, score_rows(generator.runner, rows, top_k, length, generator.tokenizer.pad_token_id,
                                      wanted_from=wanted)))


def standard_size(batch: RequestBatch, prompts: int) -> int:
    """The next power of two of ``prompts``, unless that would break the batch's budget."""
    rows_per_prompt = batch.requests[0].rows_per_prompt
    fits = max(prompts, batch.budget // (batch.length * rows_per_prompt))
    return min(1 << (prompts - 1).bit_length(), fits)


def _pick(request: Request, seqs: list, scores: list, n_prompt: int) -> list[tuple]:
    """The n choices of one prompt from its candidates (with their scores)."""
    pairs = list(zip(seqs, scores))
    if request.sampling and request.best_of > request.n:
        # OpenAI's best_of: the candidates with the highest log-probability per token.
        def mean_logprob(pair):
            seq, score = pair
            at = n_prompt - score.first  # the first generated token's score
            lps = score.token_logprobs[at : at + len(seq.token_ids)]
            return sum(lps) / max(1, len(lps))

        pairs = sorted(pairs, key=mean_logprob, reverse=True)
    if len(pairs) >= request.n:
        return pairs[: request.n]
    # Greedy search gives one answer; its n choices are copies of it.
    return [pairs[0]] * request.n
