"""The resumable request-file runner: ``bloom.py --requests in.jsonl --results out.jsonl``.

Nothing is lost and nothing is done twice:

- each batch's records are appended to the results file in one write, flushed and fsynced before
  the next batch starts, so a kill loses at most the batch in flight;
- one run at a time: the results file is locked (``flock``) for the whole run, and a second run
  on it stops with a clear line;
- on start, the results file is read back: a torn last record (killed mid-write) is cut off, a
  complete last record without its newline gets one, anything else unterminated stops the run
  (it is not ours to cut), and every request already answered is skipped. Requests are
  identified by their content, counted: identical requests are interchangeable, so if the input
  holds a request three times and the results two, one more answer is due;
- a malformed line, one that does not fit the model or the memory, or one whose answer fails for
  any reason, is reported with its line number on stderr and in the errors file (rewritten each
  run, since it follows from the input), and the other lines carry on: a failed batch is retried
  request by request, so only the poisoned line loses its answer.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..run.batch import InputError
from ..run.request_batch import RequestBatch, answer_batch
from ..request.options import OptionError
from ..run.progress import Progress, log
from ..request.parse import Request, RequestError, batch_length, parse_request, request_key
from ..request.validate import check_request
from ..search.guesses import SpeculationError
from ..search.speculation import SpeculationStats
from .grouping import plan_batches
from .files import check_distinct, disk_error, is_regular_or_new, lock_results, read_user_file
from .parts import fold_parts, settled_lines

DEFAULT_BUDGET = 8192  # tokens (rows x static length) per batch


@dataclass
class JobSummary:
    requests: int  # valid requests in the input
    skipped: int  # already answered by an earlier run
    answered: int  # answered by this run
    errors: int  # malformed lines and requests that failed
    completion_tokens: int
    seconds: float
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    speculation: SpeculationStats | None = None  # what speculative decoding did, over every batch (None: off)


# --- reading ------------------------------------------------------------------------------------


def jsonl_lines(data: bytes) -> list[str]:
    """Lines of a JSONL file, split at newlines only: str.splitlines would also split inside JSON
    strings that hold raw U+2028 or U+0085 characters, which JSON allows."""
    return [line.rstrip("\r") for line in data.decode("utf-8").split("\n")]


def read_requests(path: str | Path) -> tuple[list[Request], list[tuple[int, str, str]]]:
    """Valid requests and (line, message, text) of the malformed lines. Each line is decoded on its
    own, so a byte that is not UTF-8 refuses that line only."""
    data = read_user_file(path, "requests")
    requests, errors = [], []
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            text = raw.decode("utf-8").rstrip("\r")
        except UnicodeDecodeError as error:
            errors.append((number, f"not UTF-8 text (byte {error.start + 1})", raw.decode("utf-8", "replace")))
            continue
        if not text.strip():
            continue
        try:
            requests.append(parse_request(text, number))
        except RequestError as error:
            errors.append((number, str(error), text))
    return requests, errors


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line)["request"], dict)
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


def repair_results(results_path: Path) -> None:
    """Make the results file end with a newline before anything is appended to it.

    A complete record without its newline gets one. A torn record of ours (a kill in the middle of
    a write: it starts as our records do but does not parse) is cut off and answered again. Any
    other unterminated last line is not ours to cut: the run stops and says so."""
    try:
        data = results_path.read_bytes()
    except FileNotFoundError:
        return
    if not data or data.endswith(b"\n"):
        return
    start = data.rfind(b"\n") + 1
    last = data[start:]
    if _is_record(last):
        with open(results_path, "ab") as f:
            f.write(b"\n")
    elif last.startswith(b'{"request": ') or b'{"request": '.startswith(last):  # torn even before its key
        with open(results_path, "r+b") as f:
            f.truncate(start)
    else:
        raise InputError(f"results file {results_path} does not end with a newline and its last line is not a "
                         "result record: is it the right file? Fix or remove that line to resume")


def answered_keys(results_path: Path) -> Counter:
    """Keys of the requests the results file already answers."""
    try:
        data = results_path.read_bytes()
    except FileNotFoundError:
        return Counter()
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
        except (ValueError, KeyError, TypeError, RecursionError):
            raise InputError(f"results file {results_path} line {number} is not a result record; "
                             "fix or remove that line to resume") from None
    return done


# --- the run ------------------------------------------------------------------------------------


def job_paths(requests_path, results_path, errors_path, budget: int) -> tuple[Path, Path]:
    """A job's results and errors files (errors beside the results by default), checked distinct from
    the requests and each other, and its ``budget`` checked: before anything is read or written."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise InputError(f"--budget must be an integer >= 1 token, got {budget!r}")
    results_path = Path(results_path)
    errors_path = Path(errors_path) if errors_path else results_path.with_name(results_path.name + ".errors.jsonl")
    check_distinct({"--requests": requests_path}, {"--results": results_path, "--errors": errors_path})
    return results_path, errors_path


def run_requests(generator, requests_path, results_path, *, errors_path=None, budget: int = DEFAULT_BUDGET,
                 progress: bool = True, write: bool = True) -> JobSummary:
    """Answer every request of ``requests_path`` not yet in ``results_path``; see the module doc.

    ``progress``: show requests done, requests/s and tokens/s on stderr (``generation/run/progress.py``).
    ``write=False``: tensor-parallel ranks other than 0 run the same batches (they read the same
    results file before rank 0 can append to it: the first batch needs every rank) but write
    nothing and show nothing."""
    start = time.perf_counter()
    results_path, errors_path = job_paths(requests_path, results_path, errors_path, budget)
    requests, bad_lines = read_requests(requests_path)
    # The lock comes before the results are read back: a second run would otherwise see the same
    # requests pending and answer them twice.
    out = lock_results(results_path) if write else open(os.devnull, "ab")
    try:
        # A FIFO or a device holds no earlier results to resume from (reading one would block).
        regular = is_regular_or_new(results_path)
        if write and regular:
            repair_results(results_path)
            fold_parts(results_path, out)  # answers a killed data-parallel run left in its part files
        if not regular:
            done = Counter()
        elif write:
            done = answered_keys(results_path)
        else:  # rank 0 may be folding parts right now: count what the fold leaves, whenever we look
            done = Counter(request_key(json.loads(line)["request"]) for line in settled_lines(results_path))
        with open(errors_path if write else os.devnull, "w", encoding="utf-8") as errors:
            return _run(generator, requests, bad_lines, done, requests_path, results_path, out, errors, budget,
                        progress, write, start)
    finally:
        out.close()


def _run(generator, requests, bad_lines, done, requests_path, results_path, out, errors, budget, progress, write,
         start) -> JobSummary:
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

    failed = len(bad_lines)
    lengths, fitting = {}, []
    for r in pending:
        try:
            lengths[r.line] = [len(ids) for ids in generator.tokenizer.encode_batch(r.prompts)]
            check_request(generator, r, lengths[r.line])
        except Exception as error:  # noqa: BLE001 - one line's problem, whatever it is, is that line's
            report(r.line, error_text(error), json.dumps(r.raw, ensure_ascii=False))
            failed += 1
            continue
        fitting.append(r)
    answered, tokens, cached = 0, 0, 0
    speculated = SpeculationStats() if getattr(generator, "speculation", None) is not None else None
    bar = Progress(len(fitting), "requests", "requests", enabled=progress and write)

    def save(records: list[dict]) -> None:
        # One write per batch, on disk before the next batch starts.
        data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records).encode("utf-8")
        try:
            out.write(data)
            out.flush()
            if write:
                fsync(out)
        except OSError as error:
            raise disk_error(results_path, error) from None

    with bar:
        for batch in plan_batches(fitting, lengths, budget):
            outcomes = answer_or_split(generator, batch, speculated)
            for records, batch_tokens, failures in outcomes:
                for r, message in failures:
                    report(r.line, message, json.dumps(r.raw, ensure_ascii=False))
                failed += len(failures)
                if records:
                    save(records)
                    cached += sum(rec["result"]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                  for rec in records)
                answered += len(records)
                tokens += batch_tokens
            bar.update(len(batch.requests), f"{tokens / bar.elapsed:.1f} tokens/s")
    return JobSummary(len(requests), skipped, answered, failed, tokens, time.perf_counter() - start, cached,
                      speculated)


def fsync(f) -> None:
    """On disk before the next batch; a FIFO or a device has no disk (fsync says EINVAL)."""
    try:
        os.fsync(f.fileno())
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise


def error_text(error: BaseException) -> str:
    """One line for an error record: the message, with the kind of error when it is not ours."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if isinstance(error, (InputError, OptionError, RequestError, SpeculationError)):
        return message
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def answer_or_split(generator, batch: RequestBatch,
                    speculated: SpeculationStats | None = None) -> list[tuple[list[dict], int, list]]:
    """Answer a batch; if it fails, answer each of its requests alone, so that one poisoned line
    costs its own answer only. Returns (records, tokens, [(request, message)]) per attempt.
    ``speculated``: what each generate call's speculation did is added to it."""
    try:
        before = generator.last_stats
        records, tokens = answer_batch(generator, batch)
        # A batch that generated (echo alone does not) left its call's stats in last_stats.
        if speculated is not None and generator.last_stats is not before and generator.last_stats.speculation:
            speculated.add(generator.last_stats.speculation)
        return [(records, tokens, [])]
    except Exception as error:  # noqa: BLE001 - see the docstring: the job carries on
        if len(batch.requests) == 1:
            return [([], 0, [(batch.requests[0], error_text(error))])]
    outcomes = []
    for r, lengths in zip(batch.requests, batch.prompt_lengths):
        alone = RequestBatch([r], [lengths], batch_length(max(lengths), r.max_tokens), batch.budget)
        outcomes += answer_or_split(generator, alone, speculated)
    return outcomes
