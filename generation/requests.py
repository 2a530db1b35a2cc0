"""One request, as OpenAI's completions API shapes it: parsed and range-checked once, for the
batch runner's request files and the server alike.

A request is a JSON object in the legacy completions format (``prompt``, ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``best_of``, ``logprobs``, ``echo``, ``stop``, ``seed``), plus
our search options (``top_k``, ``num_beams``, ``repetition_penalty``...). How it is answered:
``answers.py``; request files (grouping, resume): ``jobs/``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .batch import round_up
from .options import MAX_INT, OPTIONS_BY_NAME, GenerationOptions, OptionError
from .search.stopping import StopError, normalize_stops

SHAPE_MULTIPLE = 32  # batch lengths (prompt + max_tokens) are padded to a multiple of this
MAX_LOGPROBS = 5  # as OpenAI's completions endpoint
MAX_CHOICES = 128  # n and best_of, as OpenAI's bound on n: more is a mistake, not a request
MAX_DEPTH = 32  # a request is a flat object; deep nesting is an attack or a broken file
MAX_LINE = 64 << 20  # characters per line

# Request keys that name the model or the caller: accepted and ignored.
IGNORED_KEYS = {"engine", "model", "user", "id", "request_id"}
# OpenAI keys we do not implement: accepted only with the value that means "off".
NEUTRAL_KEYS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "stream": False, "suffix": None}
# Generation options a request may set directly; the others fix shapes or are set from the format.
SEARCH_OPTIONS = {"top_k", "num_beams", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                  "early_stopping", "min_new_tokens"}
FORMAT_KEYS = {"prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "logprobs", "echo", "stop", "seed"}


class RequestError(ValueError):
    """A request line that cannot be answered; the message says why, for the user."""


@dataclass
class Request:
    line: int  # 1-based line number in the input file
    raw: dict  # the request as read, echoed back in its record
    prompts: list[str]
    max_tokens: int
    n: int  # choices returned per prompt
    best_of: int  # candidates generated per prompt (sampling: the n best are kept)
    logprobs: int | None  # top alternatives per token; None: no logprobs at all
    echo: bool
    stop: list[str]
    search: dict = field(default_factory=dict)  # GenerationOptions values of the search
    # Token ids the caller gave instead of text (the server's token prompts; ``prompts`` then holds
    # their decoding): a scoring-only request scores these very ids.
    prompt_ids: list[list[int]] | None = None

    @property
    def key(self) -> str:
        """What identifies the request across runs: its content (identical requests are
        interchangeable, so counting them is enough to resume)."""
        return request_key(self.raw)

    @property
    def group(self) -> tuple:
        """Requests with the same group share one generate call's options. Their max_tokens and
        seeds may differ (each row stops at its own budget and samples with its own seed), but
        scoring-only requests (max_tokens 0, echo) make no generate call and go apart."""
        return tuple(sorted(self.shared_search.items())) + (("generates", self.max_tokens > 0),)

    @property
    def shared_search(self) -> dict:
        """The search options a batch shares: all but the seed."""
        return {name: value for name, value in self.search.items() if name != "seed"}

    @property
    def sampling(self) -> bool:
        return bool(self.search.get("do_sample"))

    @property
    def rows_per_prompt(self) -> int:
        """Rows of the batch one prompt occupies: its beams, or its sampled candidates."""
        return max(self.search.get("num_beams", 1), self.best_of if self.sampling else 1)


def request_key(raw: dict) -> str:
    return json.dumps(raw, sort_keys=True, ensure_ascii=False)


# --- parsing ------------------------------------------------------------------------------------


def _int(raw: dict, name: str, default, low: int, high: int | None = MAX_INT):
    value = raw.get(name, default)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16; inf and nan are not integers (is_integer is false)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f">= {low}"
        raise RequestError(f"{name} must be {bound}, got {value}")
    return value


def _float(raw: dict, name: str, default: float) -> float:
    value = raw.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):  # 1e400 reads as inf
        raise RequestError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _reject_constant(name: str):
    raise RequestError(f"{name} is not a number JSON allows; use a finite number")


def _check_text(value, depth: int = 0) -> None:
    """Every string of the request must be encodable text (JSON allows a lone surrogate such as
    "\\ud800", which no tokenizer or UTF-8 file can hold), and nesting stays shallow."""
    if depth > MAX_DEPTH:
        raise RequestError(f"the request is nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(f"text {value[:20]!r} holds a lone surrogate (not valid Unicode)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(k, depth + 1)
            _check_text(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_text(v, depth + 1)


def _search_value(name: str, value):
    """A search option as JSON must already have its type: "3" is not an integer (as for max_tokens)."""
    kind = OPTIONS_BY_NAME[name].type
    if name == "early_stopping" and value == "never":
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        ok, wanted = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, wanted = number and float(value).is_integer(), "an integer"
    else:
        ok, wanted = number and math.isfinite(value), "a finite number"
    if not ok:
        raise RequestError(f"{name} must be {wanted}, got {value!r}")
    return value


def parse_request(text: str, line: int) -> Request:
    """One input line -> a checked Request; RequestError names what is wrong."""
    if len(text) > MAX_LINE:
        raise RequestError(f"the line is longer than {MAX_LINE} characters")
    try:
        raw = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise RequestError(f"not valid JSON ({error.msg}, column {error.colno})") from None
    except RecursionError:
        raise RequestError(f"the request is nested more than {MAX_DEPTH} levels deep") from None
    if not isinstance(raw, dict):
        raise RequestError(f"a request must be a JSON object, got {type(raw).__name__}")
    _check_text(raw)
    for key in sorted(set(raw) - FORMAT_KEYS - SEARCH_OPTIONS - IGNORED_KEYS - set(NEUTRAL_KEYS)):
        raise RequestError(f"unknown key {key!r}")
    for key, neutral in NEUTRAL_KEYS.items():
        if key in raw and raw[key] not in (neutral, None):
            raise RequestError(f"{key} is not supported (only {json.dumps(neutral)})")

    prompt = raw.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompt must be a string or a non-empty list of strings")
    if any(p == "" for p in prompts):
        raise RequestError("prompt is empty: nothing to continue from")
    max_tokens = _int(raw, "max_tokens", 16, 0)
    n = _int(raw, "n", 1, 1, MAX_CHOICES)
    best_of = _int(raw, "best_of", n, 1, MAX_CHOICES)
    if best_of < n:
        raise RequestError(f"best_of ({best_of}) must be >= n ({n})")
    logprobs = _int(raw, "logprobs", None, 0, MAX_LOGPROBS)
    echo = raw.get("echo", False)
    if not isinstance(echo, bool):
        raise RequestError(f"echo must be true or false, got {echo!r}")
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens is 0: nothing to return unless echo is true")
    try:
        stop = normalize_stops(raw.get("stop"))
    except StopError as error:
        raise RequestError(str(error)) from None

    temperature = _float(raw, "temperature", 1.0)  # OpenAI's default
    top_p = _float(raw, "top_p", 1.0)
    if temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {temperature}")
    search = {k: _search_value(k, raw[k]) for k in SEARCH_OPTIONS if raw.get(k) is not None}
    beams = search.get("num_beams", 1)
    # temperature 0 is greedy; above 0 it samples, unless num_beams asks for beam search.
    if temperature > 0 and beams == 1:
        search.update(do_sample=True, temperature=temperature, top_p=top_p)
        search["num_return_sequences"] = best_of
    elif beams != 1:
        if isinstance(beams, int) and best_of > beams:
            raise RequestError(f"beam search returns at most num_beams ({beams}) choices; got n={n}, best_of={best_of}")
        search["num_return_sequences"] = best_of
    seed = _int(raw, "seed", None, 0)
    if seed is not None:
        search["seed"] = seed
    try:
        checked = GenerationOptions().updated(**search)  # types and ranges, with the options' messages
        search = {k: getattr(checked, k) for k in search}
    except OptionError as error:
        raise RequestError(str(error)) from None
    return Request(line, raw, prompts, max_tokens, n, best_of, logprobs, echo, stop, search)


def batch_length(longest_prompt: int, max_tokens: int) -> int:
    return round_up(longest_prompt + max_tokens, SHAPE_MULTIPLE)
