"""The resumable request-file runner: ``bloom.py --requests in.jsonl --results out.jsonl``.

Nothing is lost and nothing is done twice:

- each batch's records are appended to the results file in one write, flushed and fsynced before
  the next batch starts, so a kill loses at most the batch in flight;
- on start, the results file is read back: a torn last line (killed mid-write) is cut off, and
  every request already answered is skipped. Requests are identified by their content, counted:
  identical requests are interchangeable, so if the input holds a request three times and the
  results two, one more answer is due;
- a malformed line is reported with its line number on stderr and in the errors file (rewritten
  each run, since it follows from the input), and the other lines carry on.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..batch import InputError
from ..logprobs import TokenText, score_rows
from ..options import OptionError
from ..progress import Progress, log
from .requests import (Choice, Request, RequestBatch, RequestError, choice_record, parse_request, plan_batches,
                       request_key, result_record)

DEFAULT_BUDGET = 8192  # tokens (rows x static length) per batch


@dataclass
class JobSummary:
    requests: int  # valid requests in the input
    skipped: int  # already answered by an earlier run
    answered: int  # answered by this run
    errors: int  # malformed lines and requests that failed
    completion_tokens: int
    seconds: float


# --- reading ------------------------------------------------------------------------------------


def jsonl_lines(data: bytes) -> list[str]:
    """Lines of a JSONL file, split at newlines only: str.splitlines would also split inside JSON
    strings that hold raw U+2028 or U+0085 characters, which JSON allows."""
    return [line.rstrip("\r") for line in data.decode("utf-8").split("\n")]


def read_requests(path: str | Path) -> tuple[list[Request], list[tuple[int, str, str]]]:
    """Valid requests and (line, message, text) of the malformed lines."""
    try:
        lines = jsonl_lines(Path(path).read_bytes())
    except FileNotFoundError:
        raise InputError(f"requests file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"cannot read requests file {path}: {error}") from None
    requests, errors = [], []
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            requests.append(parse_request(text, number))
        except RequestError as error:
            errors.append((number, str(error), text))
    return requests, errors


def answered_keys(results_path: Path) -> Counter:
    """Keys of the requests the results file already answers; cuts off a torn last line."""
    if not results_path.exists():
        return Counter()
    data = results_path.read_bytes()
    if data and not data.endswith(b"\n"):
        # Killed in the middle of a write: the partial line is dropped and answered again.
        with open(results_path, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)
        data = data[: data.rfind(b"\n") + 1]
    try:
        lines = jsonl_lines(data)
    except UnicodeDecodeError:
        raise InputError(f"results file {results_path} is not UTF-8 text") from None
    done = Counter()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            done[request_key(json.loads(line)["request"])] += 1
        except (json.JSONDecodeError, KeyError, TypeError):
            raise InputError(f"results file {results_path} line {number} is not a result record; "
                             "fix or remove that line to resume") from None
    return done


# --- answering ----------------------------------------------------------------------------------


def answer_batch(generator, batch: RequestBatch) -> tuple[list[dict], int]:
    """Records of every request of the batch (input order within the batch) and the number of
    completion tokens they hold."""
    start = time.perf_counter()
    requests = batch.requests
    prompts = [p for r in requests for p in r.prompts]
    owner = [r for r in requests for _ in r.prompts]
    if requests[0].max_tokens > 0:
        # Filler rows (copies of the last prompt, dropped after) round the batch up to a standard
        # size, so that a group's short last batch replays a graph already captured.
        fill = standard_size(batch, len(prompts)) - len(prompts)
        stops = [r.stop for r in owner] + [owner[-1].stop] * fill
        budgets = [r.max_tokens for r in owner] + [owner[-1].max_tokens] * fill
        results = generator.generate(prompts + [prompts[-1]] * fill, batch.options(), stop=stops,
                                     max_new_tokens_each=budgets)[: len(prompts)]
        prompt_ids = [res.prompt_token_ids for res in results]
        candidates = [res.sequences for res in results]
    else:  # echo with max_tokens 0: score the prompt, generate nothing
        given = [ids for r in requests for ids in (r.prompt_ids or [None] * len(r.prompts))]
        prompt_ids = [ids if ids is not None else encoded
                      for ids, encoded in zip(given, generator.tokenizer.encode_batch(prompts))]
        candidates = [[None] for _ in prompts]

    # One scoring pass over every candidate that needs log-probs (asked for, or to rank best_of).
    needs = [r.logprobs is not None or (r.sampling and r.best_of > r.n) for r in owner]
    rows, where = [], []
    for i, (ids, seqs) in enumerate(zip(prompt_ids, candidates)):
        if needs[i]:
            for j, seq in enumerate(seqs):
                rows.append(list(ids) + (seq.token_ids if seq is not None else []))
                where.append((i, j))
    scores: dict[tuple[int, int], object] = {}
    if rows:
        top_k = max((r.logprobs or 0) for r in owner)
        length = max(batch.length, max(len(r) for r in rows))
        scores = dict(zip(where, score_rows(generator.runner, rows, top_k, length, generator.tokenizer.pad_token_id)))

    text_of = TokenText(generator.tokenizer)
    per_request: dict[int, list[dict]] = {id(r): [] for r in requests}
    usage = {id(r): [0, 0] for r in requests}
    for i, (request, ids, seqs) in enumerate(zip(owner, prompt_ids, candidates)):
        picks = _pick(request, seqs, [scores.get((i, j)) for j in range(len(seqs))], len(ids))
        choices = per_request[id(request)]
        for seq, score in picks:
            choice = Choice(prompts[i], ids, seq, score)
            choices.append(choice_record(len(choices), choice, request, text_of))
            usage[id(request)][1] += len(seq.token_ids) if seq is not None else 0
        usage[id(request)][0] += len(ids)
    seconds = time.perf_counter() - start
    records, tokens = [], 0
    for r in requests:
        p, c = usage[id(r)]
        tokens += c
        records.append(result_record(r, per_request[id(r)], {"prompt_tokens": p, "completion_tokens": c,
                                                            "total_tokens": p + c}, seconds, len(prompts)))
    return records, tokens


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
            lps = score.token_logprobs[n_prompt - 1 : n_prompt - 1 + len(seq.token_ids)]
            return sum(lps) / max(1, len(lps))

        pairs = sorted(pairs, key=mean_logprob, reverse=True)
    if len(pairs) >= request.n:
        return pairs[: request.n]
    # Greedy search gives one answer; its n choices are copies of it.
    return [pairs[0]] * request.n


# --- the run ------------------------------------------------------------------------------------


def run_requests(generator, requests_path, results_path, *, errors_path=None, budget: int = DEFAULT_BUDGET,
                 progress: bool = True, write: bool = True) -> JobSummary:
    """Answer every request of ``requests_path`` not yet in ``results_path``; see the module doc.

    ``progress``: show requests done, requests/s and tokens/s on stderr (``generation/progress.py``).
    ``write=False``: tensor-parallel ranks other than 0 run the same batches (they read the same
    results file before rank 0 can append to it: the first batch needs every rank) but write
    nothing and show nothing."""
    if budget < 1:
        raise InputError(f"--budget must be >= 1 token, got {budget}")
    start = time.perf_counter()
    results_path = Path(results_path)
    errors_path = Path(errors_path) if errors_path else results_path.with_name(results_path.name + ".errors.jsonl")
    requests, bad_lines = read_requests(requests_path)
    done = answered_keys(results_path)

    errors = open(errors_path if write else os.devnull, "w", encoding="utf-8")

    def report(line: int, message: str, text: str) -> None:
        if write:
            log(f"{requests_path}: line {line}: {message}")
        errors.write(json.dumps({"line": line, "error": message, "text": text}, ensure_ascii=False) + "\n")
        errors.flush()

    for line, message, text in bad_lines:
        report(line, message, text)
    pending = []
    for r in requests:
        if done[r.key] > 0:
            done[r.key] -= 1
        else:
            pending.append(r)
    skipped = len(requests) - len(pending)
    if skipped and write:
        log(f"resuming: {skipped} of {len(requests)} requests already answered in {results_path}")

    encoded = generator.tokenizer.encode_batch([p for r in pending for p in r.prompts])
    lengths, at = {}, 0
    for r in pending:
        lengths[r.line] = [len(ids) for ids in encoded[at : at + len(r.prompts)]]
        at += len(r.prompts)
    answered, failed, tokens = 0, len(bad_lines), 0
    bar = Progress(len(pending), "requests", "requests", enabled=progress and write)
    with bar, open(results_path if write else os.devnull, "a", encoding="utf-8") as out:
        for batch in plan_batches(pending, lengths, budget):
            try:
                records, batch_tokens = answer_batch(generator, batch)
            except (InputError, OptionError, RequestError, ValueError) as error:
                for r in batch.requests:
                    report(r.line, str(error), json.dumps(r.raw, ensure_ascii=False))
                failed += len(batch.requests)
                bar.update(len(batch.requests))
                continue
            # One write per batch, on disk before the next batch starts.
            out.write("".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records))
            out.flush()
            if write:
                os.fsync(out.fileno())
            answered += len(records)
            tokens += batch_tokens
            bar.update(len(records), f"{tokens / bar.elapsed:.1f} tokens/s")
    errors.close()
    return JobSummary(len(requests), skipped, answered, failed, tokens, time.perf_counter() - start)
