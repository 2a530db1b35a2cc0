"""One request, as OpenAI's completions API shapes it: parsed and range-checked once, for the
batch runner's request files and the server alike, and turned into generation options in one step
(``Request.to_options``; the server's per-row form is ``serving.params.SamplingParams.of``).

A request is a JSON object in the legacy completions format (``prompt``, ``max_tokens``,
``temperature``, ``top_p``, ``n``, ``best_of``, ``logprobs``, ``echo``, ``stop``, ``seed``), plus
our search options (``top_k``, ``num_beams``, ``repetition_penalty``...) and structured output
(``response_format``, ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``:
``structured.py``; greedy search and sampling only). The server also takes
chat bodies (``from_chat``: a completion of the prompt its messages make), OpenAI's presence and
frequency penalties and vLLM's ``ignore_eos`` and ``min_tokens``.

Each field is checked here and only here: a request's own fields against ``RANGES``, the search
options (temperature, top_p, seed, top_k...) by ``GenerationOptions`` against ``options.RANGES``.
The server's schema documents the same ranges (``documented_range``). How a request is answered:
``answers.py``; request files (grouping, resume): ``jobs/``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from ..run.batch import round_up
from .options import MAX_INT, OPTIONS_BY_NAME, GenerationOptions, OptionError, Range
from .options import documented_range as option_range
from ..search.stopping import StopError, normalize_stops
from .grammar import FIELDS as STRUCTURED_KEYS, Grammar, GrammarError, grammar_from_fields

SHAPE_MULTIPLE = 32  # batch lengths (prompt + max_tokens) are padded to a multiple of this
MAX_LOGPROBS = 5  # as OpenAI's completions endpoint
MAX_CHOICES = 128  # n and best_of, as OpenAI's bound on n: more is a mistake, not a request
MAX_DEPTH = 32  # a request is a flat object; deep nesting is an attack or a broken file
MAX_LINE = 64 << 20  # characters per line
CHAT_MAX_TOKENS = 1 << 30  # chat without max_tokens: the rest of the server's max_length (the engine caps it)

# A request's own fields and their ranges (the search options' are options.RANGES).
RANGES = {
    "max_tokens": Range(0, MAX_INT),
    "n": Range(1, MAX_CHOICES),
    "best_of": Range(1, MAX_CHOICES),
    "logprobs": Range(0, MAX_LOGPROBS),
    "presence_penalty": Range(-2.0, 2.0, text="a number between -2.0 and 2.0"),
    "frequency_penalty": Range(-2.0, 2.0, text="a number between -2.0 and 2.0"),
    "min_tokens": Range(0, MAX_INT),
}
# A chat body's own: chat asks for at least one token.
CHAT_RANGES = {
    "max_tokens": Range(1, MAX_INT),
    "max_completion_tokens": Range(1, MAX_INT),
    "top_logprobs": Range(0, MAX_LOGPROBS),
}

# Request keys that name the model or the caller: accepted and ignored.
IGNORED_KEYS = {"engine", "model", "user", "id", "request_id"}
# OpenAI keys we do not implement: accepted only with the value that means "off". (The server
# honours the penalties, SERVER_KEYS, and answers ``stream`` itself before a body comes here.)
NEUTRAL_KEYS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "stream": False, "suffix": None}
# Generation options a request may set directly; the others fix shapes or are set from the format.
SEARCH_OPTIONS = {"top_k", "num_beams", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
                  "early_stopping", "min_new_tokens"}
FORMAT_KEYS = {"prompt", "max_tokens", "temperature", "top_p", "n", "best_of", "logprobs", "echo", "stop", "seed"}
SERVER_KEYS = {"presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens"}
CHAT_ONLY_KEYS = ("messages", "max_completion_tokens", "logprobs", "top_logprobs")


class RequestError(ValueError):
    """A request that cannot be answered; the message says why, for the user."""


@dataclass
class Request:
    line: int  # 1-based line number in the input file (0: a server's body)
    raw: dict  # the request as read, echoed back in its record
    prompts: list[str]
    max_tokens: int
    n: int  # choices returned per prompt
    best_of: int  # candidates generated per prompt (sampling: the n best are kept)
    logprobs: int | None  # top alternatives per token; None: no logprobs at all
    echo: bool
    stop: list[str]
    # The search, checked once (``_search``): its options as the generate call that answers the
    # request takes them, seed and ignore_eos included; max_length and max_new_tokens are the
    # batch's (``to_options``).
    options: GenerationOptions = field(default_factory=lambda: GenerationOptions(ignore_eos=False))
    # Token ids the caller gave instead of text (the server's token prompts; ``prompts`` then holds
    # their decoding): a scoring-only request scores these very ids.
    prompt_ids: list[list[int]] | None = None
    # The server's only (a request file accepts only their "off" values):
    presence_penalty: float = 0.0  # OpenAI's, over generated tokens
    frequency_penalty: float = 0.0
    grammar: Grammar | None = None  # structured output: what every answer must match (structured.py)

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
        return self.to_options(), self.max_tokens > 0

    @property
    def ignore_eos(self) -> bool:
        """vLLM's: rows do not stop at EOS (the server's only)."""
        return self.options.ignore_eos

    @property
    def sampling(self) -> bool:
        return self.options.do_sample

    @property
    def rows_per_prompt(self) -> int:
        """Rows of the batch one prompt occupies: its beams, or its sampled candidates."""
        return max(self.options.num_beams, self.best_of if self.sampling else 1)

    def to_options(self, **shape) -> GenerationOptions:
        """The options of a generate call that answers it, the seed aside (each prompt brings its
        own, ``seed_each``); ``shape``: what its batch fixes (``max_length``, ``max_new_tokens``).
        Checked when the request was read: nothing is checked again here."""
        return replace(self.options, seed=None, **shape)


def request_key(raw: dict) -> str:
    return json.dumps(raw, sort_keys=True, ensure_ascii=False)


def batch_length(longest_prompt: int, max_tokens: int) -> int:
    return round_up(longest_prompt + max_tokens, SHAPE_MULTIPLE)


def documented_range(name: str, chat: bool = False) -> dict:
    """A field's range in JSON schema's words, for the server's schema (``serving/schema.py``)."""
    if chat and name in CHAT_RANGES:
        return CHAT_RANGES[name].schema()
    if name in RANGES:
        return RANGES[name].schema()
    if name == "temperature":  # 0: greedy search; above it, the sampling temperature's range
        return {"minimum": 0}
    return option_range(name)


# --- the parts of a body ------------------------------------------------------------------------


def _int(raw: dict, name: str, default, allowed: Range | None = None):
    value = raw.get(name, default)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # 16.0 is 16; inf and nan are not integers (is_integer is false)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    if allowed is not None and not allowed.holds(value):
        raise RequestError(allowed.message(name, value))
    return value


def _float(raw: dict, name: str, default: float, allowed: Range | None = None) -> float:
    value = raw.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"{name} must be a number, got {value!r}")
    if allowed is not None and not allowed.holds(value):
        raise RequestError(allowed.message(name, value))
    try:
        return float(value)
    except OverflowError:  # an integer with hundreds of digits
        raise RequestError(f"{name} must be a finite number, got {value}") from None


def _bool(raw: dict, name: str, default: bool) -> bool:
    value = raw.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}")
    return value


def _reject_constant(name: str):
    raise RequestError(f"{name} is not a number JSON allows; use a finite number")


def _check_values(raw: dict) -> None:
    """Every number finite (Python's JSON parser reads NaN, Infinity and 1e400; JSON has none of
    them), every string encodable text (JSON allows a lone surrogate such as "\\ud800", which no
    tokenizer or UTF-8 file can hold), and the nesting shallow."""
    for key, value in raw.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(f"{key} must be a finite number, got {value}")
    _check_text(raw)


def _check_text(value, depth: int = 0) -> None:
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


def _check_keys(raw: dict, serving: bool) -> None:
    allowed = (FORMAT_KEYS | SEARCH_OPTIONS | IGNORED_KEYS | set(NEUTRAL_KEYS) | set(STRUCTURED_KEYS)
               | (SERVER_KEYS if serving else set()))
    for key in sorted(set(raw) - allowed):
        raise RequestError(f"unknown key {key!r}")
    for key, neutral in NEUTRAL_KEYS.items():
        if key in raw and raw[key] not in (neutral, None) and not (serving and key in SERVER_KEYS):
            raise RequestError(f"{key} is not supported (only {json.dumps(neutral)})")


def _prompts(raw: dict) -> list[str]:
    prompt = raw.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise RequestError("prompt must be a string or a non-empty list of strings")
    if any(p == "" for p in prompts):
        raise RequestError("prompt is empty: nothing to continue from")
    return prompts


def _search_value(name: str, value):
    """A search option as JSON must already have its type: "3" is not an integer (as for max_tokens)."""
    kind = OPTIONS_BY_NAME[name].type
    if name == "early_stopping" and value == "never":
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        ok, wanted = isinstance(value, bool), "true or false"
    elif kind is int:
        ok, wanted = number and (isinstance(value, int) or value.is_integer()), "an integer"
    else:
        ok, wanted = number, "a finite number"  # (_check_values has refused inf and nan)
    if not ok:
        raise RequestError(f"{name} must be {wanted}, got {value!r}")
    try:
        return int(value) if kind is int else float(value) if kind is float else value  # (3.0 is 3)
    except OverflowError:  # an integer of hundreds of digits as a float
        raise RequestError(f"{name} must be {wanted}, got {value}") from None


def _search(raw: dict, n: int, best_of: int, min_new_tokens: int | None, ignore_eos: bool) -> GenerationOptions:
    """The generation options the request asks for, checked by ``GenerationOptions.validate`` (every
    value given, used by the search or not: top_p is checked under greedy search too), the one
    check of their ranges."""
    search = {k: _search_value(k, raw[k]) for k in SEARCH_OPTIONS if raw.get(k) is not None}
    if min_new_tokens is not None:
        search["min_new_tokens"] = min_new_tokens
    temperature = _float(raw, "temperature", 1.0)  # OpenAI's default
    top_p = _float(raw, "top_p", 1.0)
    seed = _int(raw, "seed", None)
    beams = search.get("num_beams", 1)
    unused = {"top_p": top_p}
    # temperature 0 is greedy; otherwise it samples, unless num_beams asks for beam search.
    if temperature != 0 and beams == 1:
        search.update(do_sample=True, temperature=temperature, top_p=top_p, num_return_sequences=best_of)
    elif beams != 1:
        if isinstance(beams, int) and 1 <= beams < best_of:  # (num_beams < 1: its range's message, below)
            raise RequestError(f"beam search returns at most num_beams ({beams}) choices; got n={n}, best_of={best_of}")
        search["num_return_sequences"] = best_of
        if temperature != 0:
            unused["temperature"] = temperature
    if seed is not None:
        search["seed"] = seed
    try:
        checked = replace(GenerationOptions(ignore_eos=ignore_eos), **{**unused, **search}).validate()
    except OptionError as error:
        raise RequestError(str(error)) from None
    # What the search does not use goes back to its default (a greedy row has no top_p).
    return replace(checked, **{name: OPTIONS_BY_NAME[name].default for name in unused if name not in search})


# --- bodies -------------------------------------------------------------------------------------


def parse_request(text: str, line: int) -> Request:
    """One request-file line -> a checked Request; RequestError names what is wrong."""
    if len(text) > MAX_LINE:
        raise RequestError(f"the line is longer than {MAX_LINE} characters")
    try:
        raw = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as error:
        raise RequestError(f"not valid JSON ({error.msg}, column {error.colno})") from None
    except RecursionError:
        raise RequestError(f"the request is nested more than {MAX_DEPTH} levels deep") from None
    return from_body(raw, line)


def from_body(raw, line: int = 0, serving: bool = False) -> Request:
    """A completion body -> a checked Request. ``serving``: the server's body (its HTTP keys,
    ``stream`` and ``model``, already taken by the server), which may also set the penalties and
    vLLM's ``ignore_eos`` and ``min_tokens``."""
    if not isinstance(raw, dict):
        raise RequestError(f"a request must be a JSON object, got {type(raw).__name__}")
    _check_values(raw)
    _check_keys(raw, serving)
    prompts = _prompts(raw)
    max_tokens = _int(raw, "max_tokens", 16, RANGES["max_tokens"])
    n = _int(raw, "n", 1, RANGES["n"])
    best_of = _int(raw, "best_of", n, RANGES["best_of"])
    if best_of < n:
        raise RequestError(f"best_of ({best_of}) must be >= n ({n})")
    logprobs = _int(raw, "logprobs", None, RANGES["logprobs"])
    echo = _bool(raw, "echo", False)
    if max_tokens == 0 and not echo:
        raise RequestError("max_tokens is 0: nothing to return unless echo is true")
    try:
        stop = normalize_stops(raw.get("stop"))
    except StopError as error:
        raise RequestError(str(error)) from None
    ignore_eos = _bool(raw, "ignore_eos", False)
    min_tokens = _int(raw, "min_tokens", None, RANGES["min_tokens"])
    if min_tokens is not None and min_tokens > max_tokens:  # as vLLM
        raise RequestError(f"min_tokens ({min_tokens}) must be at most max_tokens ({max_tokens})")
    # With ignore_eos no row stops early, so min_tokens has nothing to add.
    options = _search(raw, n, best_of, min_tokens if min_tokens and not ignore_eos else None, ignore_eos)
    penalties = {name: _float(raw, name, 0.0, RANGES[name]) for name in ("presence_penalty", "frequency_penalty")}
    return Request(line, raw, prompts, max_tokens, n, best_of, logprobs, echo, stop, options,
                   grammar=_grammar(raw, options), **penalties)


def _grammar(raw: dict, options: GenerationOptions) -> Grammar | None:
    """The structured output a request asks for (its field's value checked by the grammar
    library; the grammar against the tokenizer: ``structured.Compiler.check``)."""
    try:
        grammar = grammar_from_fields(**{k: raw[k] for k in STRUCTURED_KEYS if raw.get(k) is not None})
    except GrammarError as error:
        raise RequestError(str(error)) from None
    if grammar is not None and options.num_beams > 1:
        raise RequestError(f"{grammar.field} works with greedy search and sampling, not with beam search (num_beams > 1)")
    return grammar


def from_chat(body: dict, prompt: str, turn_stops: list[str]) -> Request:
    """A chat body whose messages made ``prompt`` (``serving/openai_format.chat_prompt``) -> a
    checked Request: a completion of that prompt, stopping at the user's stops and where the model
    starts the next turn. Its ``logprobs`` are the chat's ``top_logprobs`` when ``logprobs`` is true."""
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, CHAT_RANGES["top_logprobs"])
    if top and not logprobs:  # as OpenAI and vLLM: alternatives without logprobs would be silently dropped
        raise RequestError("top_logprobs needs logprobs: true")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, CHAT_RANGES[name])
    try:
        stop = normalize_stops(body.get("stop")) + list(turn_stops)
    except StopError as error:
        raise RequestError(str(error)) from None
    completion = {k: v for k, v in body.items() if k not in CHAT_ONLY_KEYS}
    completion |= {"prompt": prompt, "stop": stop, "max_tokens": CHAT_MAX_TOKENS if max_tokens is None else max_tokens}
    request = from_body(completion, serving=True)
    request.logprobs = (top or 0) if logprobs else None
    return request
