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


def valid_seed(seed: int | None) -> bool:
    """A seed the sampling keys take (None: one drawn at the call)."""
    return seed is None or 0 <= seed < 2**63


class OptionError(ValueError):
    """A bad option value; the message is meant for the user as is."""


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
)
OPTIONS_BY_NAME = {o.name: o for o in OPTIONS}


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

        for name in ("temperature", "top_p", "repetition_penalty", "length_penalty"):
            value = getattr(self, name)
            need(math.isfinite(value), f"{name} must be a finite number, got {value}")
        for name in ("max_length", "max_new_tokens", "min_new_tokens", "num_beams", "top_k", "num_return_sequences",
                     "no_repeat_ngram_size", "bucket_width"):
            value = getattr(self, name)
            # Python ints have no bound; torch's and the memory's do. Memory is checked later, per
            # model; this only keeps numbers in the range a tensor index can hold.
            need(value is None or value <= MAX_INT, f"{name} must be at most {MAX_INT}, got {value}")
        need(self.max_length >= 1, f"max_length must be >= 1, got {self.max_length}")
        need(self.max_new_tokens is None or self.max_new_tokens >= 1,
             f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        need(self.min_new_tokens >= 0, f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        need(self.num_beams >= 1, f"num_beams must be >= 1, got {self.num_beams}")
        need(MIN_TEMPERATURE <= self.temperature, f"temperature must be > 0, at least {MIN_TEMPERATURE} (smaller "
             f"values overflow the logits; for greedy search leave do_sample off), got {self.temperature}")
        need(self.top_k >= 0, f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(self.no_repeat_ngram_size >= 0, f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")
        need(self.num_return_sequences >= 1, f"num_return_sequences must be >= 1, got {self.num_return_sequences}")
        need(self.do_sample or self.num_return_sequences <= self.num_beams,
             f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams}) "
             "unless do_sample is true")
        need(self.bucket_width >= 0, f"bucket_width must be >= 0 (0 turns it off), got {self.bucket_width}")
        need(valid_seed(self.seed), f"seed must be >= 0 (and below 2**63), got {self.seed}")
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
    except (TypeError, ValueError):
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
