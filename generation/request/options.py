"""Generation options: one typed table, parsed from ``--options``, CLI flags or keyword arguments.

``OPTIONS`` is the single source of truth: name, type, default, and a one-line meaning that
``--help_options`` prints. ``GenerationOptions`` holds the values; ``validate()`` turns every bad
value into an ``OptionError`` whose message names the option and the valid range.

``--options`` syntax: ``"k=v,k=v"``; a type may be given (``k:int=3``, ``k:float=0.5``,
``k:bool=true``, ``k:str=x``); ``k`` alone means true and ``!k`` false.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

MAX_INT = 2**31 - 1  # integer options beyond this cannot index a tensor on every backend
MIN_TEMPERATURE = 1e-4  # logits / 1e-4 stay finite in fp32 for any logit a model produces


class OptionError(ValueError):
    """A bad option value; the message is meant for the user as is."""


@dataclass(frozen=True)
class Range:
    """The values a number may take: the one place its check, its message and the range the
    server's schema documents come from (``RANGES`` here; a request's own fields in
    ``requests.py``)."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False  # the low end itself is out (top_p > 0)
    text: str = ""  # what the message says instead of the bounds

    def holds(self, value) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    def message(self, name: str, value) -> str:
        return f"{name} must be {self.text or self._bounds()}, got {value}"

    def _bounds(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in ({self.low}, {self.high}]" if self.low_open else f"between {self.low} and {self.high}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"at most {self.high}"

    def schema(self) -> dict:
        """JSON schema's words for the range (``minimum``...)."""
        bounds = {}
        if self.low is not None:
            bounds["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            bounds["maximum"] = self.high
        return bounds


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str


OPTIONS: tuple[Option, ...] = (
    Option("max_length", int, 128, "prompt + generated tokens per row; also the static shape (cache length)"),
    Option("max_new_tokens", int, None, "at most this many new tokens per row (within max_length)"),
    Option("min_new_tokens", int, 0, "EOS is forbidden until a row has this many new tokens"),
    Option("num_beams", int, 1, "beam search with this many beams per prompt (1: greedy or sampling)"),
    Option("do_sample", bool, False, "sample the next token instead of taking the most likely"),
    Option("temperature", float, 1.0, "divide logits by this before sampling (> 0)"),
    Option("top_k", int, 0, "sample only among the k most likely tokens (0: off)"),
    Option("top_p", float, 1.0, "sample only within the smallest set of probability mass top_p (0 < p <= 1)"),
    Option("repetition_penalty", float, 1.0, "penalise tokens already present in the row (> 0; 1: off)"),
    Option("length_penalty", float, 1.0, "beam search: score = sum logprob / length ** length_penalty"),
    Option("no_repeat_ngram_size", int, 0, "never repeat an n-gram of this size within a row (0: off)"),
    Option("early_stopping", bool, False, "beam search: true: stop a prompt once num_beams hypotheses are done; "
           "false: once no running beam can beat them (heuristic); never: only when that is certain"),
    Option("num_return_sequences", int, 1, "sequences returned per prompt (<= num_beams unless sampling)"),
    Option("ignore_eos", bool, True, "keep generating after EOS (true, as the original scripts) or stop each row at its EOS"),
    Option("seed", int, None, "seed for sampling; the same seed gives the same output"),
    Option("static_shapes", bool, True, "pad prompts and the cache to static shapes (the recipe)"),
    Option("use_graphs", bool, True, "capture steps as HPU/CUDA graphs and replay them"),
    Option("use_kv_cache", bool, True, "reuse keys/values of earlier tokens (false: recompute the whole sequence each step)"),
    Option("bucket_width", int, 0, "pad prompts and size the cache/attention window in multiples of this (0: off)"),
    # Structured output (docs/structured-output.md); the library's generate also takes them as objects.
    Option("guided_json", str, None, "every answer follows the JSON schema in this file"),
    Option("guided_regex", str, None, "every answer matches this regular expression (no commas: they separate options)"),
    Option("guided_choice", str, None, "every answer is one of these |-separated strings"),
    Option("guided_grammar", str, None, "every answer follows the Lark or GBNF grammar in this file"),
)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}
# The range of each numeric option (an integer option also stays at most MAX_INT).
RANGES = {
    "max_length": Range(1),
    "max_new_tokens": Range(1),
    "min_new_tokens": Range(0),
    "num_beams": Range(1),
    "temperature": Range(MIN_TEMPERATURE, text=f"> 0, at least {MIN_TEMPERATURE} (smaller values overflow the logits; "
                         "for greedy search leave do_sample off, or send temperature 0 in a request)"),
    "top_k": Range(0, text=">= 0 (0 turns it off)"),
    "top_p": Range(0, 1, low_open=True),
    "repetition_penalty": Range(0, low_open=True),
    "no_repeat_ngram_size": Range(0),
    "num_return_sequences": Range(1),
    "bucket_width": Range(0, text=">= 0 (0 turns it off)"),
    "seed": Range(0, 2**63 - 1, text=">= 0 (and below 2**63)"),
}
FLOATS = tuple(o.name for o in OPTIONS if o.type is float)
INTS = tuple(o.name for o in OPTIONS if o.type is int and o.name != "seed")


def valid_seed(seed: int | None) -> bool:
    """A seed the sampling keys take (None: one drawn at the call)."""
    return seed is None or RANGES["seed"].holds(seed)


def documented_range(name: str) -> dict:
    """An option's range as JSON schema says it (what the server's schema documents)."""
    bounds = RANGES[name].schema() if name in RANGES else {}
    if name in INTS and "maximum" not in bounds:
        bounds["maximum"] = MAX_INT
    return bounds


@dataclass(frozen=True)
class GenerationOptions:
    max_length: int = 128
    max_new_tokens: int | None = None
    min_new_tokens: int = 0
    num_beams: int = 1
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    num_return_sequences: int = 1
    ignore_eos: bool = True
    seed: int | None = None
    static_shapes: bool = True
    use_graphs: bool = True
    use_kv_cache: bool = True
    bucket_width: int = 0
    guided_json: str | None = None
    guided_regex: str | None = None
    guided_choice: str | None = None
    guided_grammar: str | None = None
    # Typed keys we do not know, kept for the vanilla (transformers) path only.
    extra: dict = field(default_factory=dict, compare=False)

    def updated(self, **changes) -> "GenerationOptions":
        unknown = sorted(set(changes) - set(OPTIONS_BY_NAME))
        if unknown:
            raise OptionError(f"unknown option {unknown[0]!r}; see --help_options for the list")
        return replace(self, **{k: coerce(k, v) for k, v in changes.items()}).validate()

    def validate(self) -> "GenerationOptions":
        def need(ok: bool, message: str):
            if not ok:
                raise OptionError(message)

        for name in FLOATS:
            value = getattr(self, name)
            need(math.isfinite(value), f"{name} must be a finite number, got {value}")
        for name in INTS:
            value = getattr(self, name)
            # Python ints have no bound; torch's and the memory's do. Memory is checked later, per
            # model; this only keeps numbers in the range a tensor index can hold.
            need(value is None or value <= MAX_INT, f"{name} must be at most {MAX_INT}, got {value}")
        for name, allowed in RANGES.items():
            value = getattr(self, name)
            need(value is None or allowed.holds(value), allowed.message(name, value))
        need(self.do_sample or self.num_return_sequences <= self.num_beams,
             f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams}) "
             "unless do_sample is true")
        return self


_TRUE = {"true", "t", "1", "yes", "y", "on"}
_FALSE = {"false", "f", "0", "no", "n", "off"}
_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def parse_bool(text: str, name: str = "value") -> bool:
    lowered = str(text).strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise OptionError(f"{name} expects a boolean (true/false, t/f, 1/0), got {text!r}")


def _convert(name: str, value: Any, kind: type) -> Any:
    if value is None:
        return None
    if kind is bool:
        return value if isinstance(value, bool) else parse_bool(value, name)
    if isinstance(value, bool):  # True is an int in Python; never accept it as a number
        raise OptionError(f"{name} expects {kind.__name__}, got a boolean")
    try:
        if kind is int and isinstance(value, float):
            if not math.isfinite(value) or not value.is_integer():
                raise ValueError
            return int(value)
        return kind(value)
    except (TypeError, ValueError, OverflowError):  # (OverflowError: an int of hundreds of digits as a float)
        raise OptionError(f"{name} expects {kind.__name__}, got {value!r}") from None


def coerce(name: str, value: Any) -> Any:
    """Convert ``value`` to the declared type of option ``name``."""
    if name == "early_stopping" and isinstance(value, str) and value.strip().lower() == "never":
        return "never"  # transformers' third value: a boolean option with one extra word
    try:
        return _convert(name, value, OPTIONS_BY_NAME[name].type)
    except OptionError:
        if name == "early_stopping":
            raise OptionError(f"early_stopping expects true, false or never, got {value!r}") from None
        raise


def parse_options(text: str) -> tuple[dict, dict]:
    """Parse ``"k=v,k:int=3,flag,!flag"`` into (known option values, extra typed keys)."""
    known, extra = {}, {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "=" in item:
            key, raw = (s.strip() for s in item.split("=", 1))
        elif item.startswith("!"):
            key, raw = item[1:].strip(), "false"
        else:
            key, raw = item, "true"
        key, _, type_name = key.partition(":")
        if type_name and type_name not in _TYPES:
            raise OptionError(f"option {key}: unknown type {type_name!r} (use int, float, bool or str)")
        if key in OPTIONS_BY_NAME:
            declared = OPTIONS_BY_NAME[key].type
            if (type_name and _TYPES[type_name] is not declared and not (declared is float and type_name == "int")
                    and not (key == "early_stopping" and raw.strip().lower() == "never")):
                raise OptionError(f"option {key} is {declared.__name__}, not {type_name}")
            known[key] = coerce(key, raw)
        elif type_name:
            extra[key] = _convert(key, raw, _TYPES[type_name])
        else:
            raise OptionError(
                f"unknown option {key!r}; see --help_options (typed keys such as {key}:int=… pass "
                "through to transformers in vanilla mode)"
            )
    return known, extra


def build_options(options_text: str = "", **values) -> GenerationOptions:
    """Options from an ``--options`` string plus explicit values (explicit ones win)."""
    known, extra = parse_options(options_text) if options_text else ({}, {})
    unknown = sorted(set(values) - set(OPTIONS_BY_NAME))
    if unknown:
        raise OptionError(f"unknown option {unknown[0]!r}; see --help_options for the list")
    known.update({k: coerce(k, v) for k, v in values.items() if v is not None})
    return replace(GenerationOptions(), extra=extra, **known).validate()


def options_help() -> str:
    width = max(len(o.name) for o in OPTIONS)
    lines = ["Generation options (--options \"k=v,k:int=3,flag,!flag\" or keyword arguments of generate):", ""]
    for o in OPTIONS:
        default = "none" if o.default is None else str(o.default).lower() if o.type is bool else str(o.default)
        lines.append(f"  {o.name:<{width}}  {o.type.__name__:<5}  default {default:<6}  {o.help}")
    return "\n".join(lines)


assert [f.name for f in fields(GenerationOptions) if f.name != "extra"] == [o.name for o in OPTIONS]
assert all(getattr(GenerationOptions(), o.name) == o.default for o in OPTIONS)
