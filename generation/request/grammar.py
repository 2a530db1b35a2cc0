"""Structured output: JSON schemas, regular expressions, choices and grammars as a mask on the
token choice (``docs/structured-output.md``).

The grammar library is llguidance (chosen by measurement, ``bench/structured_bench.py
libraries``): it turns a request's constraint into a matcher per row, and a matcher into the row's
allowed tokens as a bitmask (``[ceil(V / 32)]`` int32, bit t of word t // 32 set when token t is
allowed). Here:

* ``grammar_from_fields``: a request's fields (``response_format``, ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar``) -> one ``Grammar`` (llguidance's grammar
  text) or None; a bad value is a ``GrammarError`` naming the field.
* ``Compiler``: grammars against one tokenizer: checked once (a bad schema, regex or grammar is
  a ``GrammarError`` naming its field; compile work bounded by ``LIMITS``), cached per grammar, a
  fresh matcher per row (a copy of the cached one).
* ``RowGrammar``: one row's grammar (its matcher, next mask, end), on the server and in the
  offline loop; ``GrammarRows`` gathers a batch's into the ``[rows, words]`` bitmask on the host
  (all bits set for a row without one), copies it to the device, and takes each chosen token back
  to advance its row's grammar.
* ``allow``: the mask applied to scores [rows, V] on the device (-inf where not allowed).

A mask is data: it enters the token choice, which runs on logits outside the captured step, with
the same shape whatever the mix of rows, so a request carrying a grammar adds no step shape.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from .options import OptionError

FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
MAX_SOURCE = 100_000  # characters of a schema, regex or grammar: larger ones are refused before compiling
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 128  # compiled grammars kept per tokenizer (least recently used dropped)


class GrammarError(OptionError):
    """A bad constraint; the message names the request's field and is meant for the user as is."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass(frozen=True)
class Grammar:
    field: str  # the request field that asked for it (named by errors)
    text: str  # llguidance's grammar (what LLMatcher takes)


def _limits():
    import llguidance

    # llguidance counts its work in fuel: a grammar whose lexer needs more than this to build is an
    # error (about 20 ms of work), and one mask step more than its step fuel (about 15 ms), so a
    # request cannot stall the engine with its constraint.
    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     max_grammar_size=200_000, verbose_errors=False)


def _source(field: str, value, kind: type | tuple) -> object:
    if not isinstance(value, kind):
        names = " or ".join(t.__name__ for t in (kind if isinstance(kind, tuple) else (kind,)))
        raise GrammarError(field, f"must be a {names.replace('dict', 'JSON object').replace('str', 'string')}, "
                                  f"got {type(value).__name__}")
    if len(json.dumps(value) if not isinstance(value, str) else value) > MAX_SOURCE:
        raise GrammarError(field, f"is longer than {MAX_SOURCE} characters")
    return value


def _schema(field: str, value) -> str:
    import llguidance

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise GrammarError(field, f"is not valid JSON: {error}") from None
    if not isinstance(value, (dict, bool)):
        raise GrammarError(field, f"must be a JSON schema (an object), got {type(value).__name__}")
    try:
        # JSON as OpenAI's servers write it (", " and ": ", no other whitespace): free whitespace
        # lets a model pad an answer without end, so a bounded schema could run out of tokens.
        return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_LAYOUT)
    except Exception as error:  # llguidance's ValueError for a schema it does not take
        raise GrammarError(field, f"invalid JSON schema: {error}") from None


def _response_format(value) -> str | None:
    field = "response_format"
    _source(field, value, dict)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _schema(field, {"type": "object"})
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or "schema" not in inner:
            raise GrammarError(field, 'type "json_schema" needs "json_schema": {"name": ..., "schema": {...}}')
        return _schema(field, inner["schema"])
    raise GrammarError(field, f'type must be "text", "json_object" or "json_schema", got {kind!r}')


def grammar_from_fields(**fields) -> Grammar | None:
    """The one constraint a request's fields ask for (None: none), as llguidance's grammar text.
    At most one field may be given; a value the library refuses is a ``GrammarError`` naming it."""
    import llguidance

    given = {name: value for name, value in fields.items() if value is not None}
    unknown = sorted(set(given) - set(FIELDS))
    if unknown:
        raise TypeError(f"unknown structured-output field {unknown[0]!r}")
    if len(given) > 1:
        raise GrammarError(sorted(given)[1], f"only one of {', '.join(FIELDS)} may be given, got {', '.join(sorted(given))}")
    if not given:
        return None
    ((field, value),) = given.items()
    if field == "response_format":
        text = _response_format(value)
        return Grammar(field, text) if text is not None else None
    if field == "guided_json":
        return Grammar(field, _schema(field, _source(field, value, (dict, str))))
    if field == "guided_regex":
        try:
            return Grammar(field, llguidance.LLMatcher.grammar_from_regex(_source(field, value, str)))
        except GrammarError:
            raise
        except Exception as error:
            raise GrammarError(field, f"invalid regular expression: {_first_lines(str(error))}") from None
    if field == "guided_choice":
        _source(field, value, list)
        if not value or not all(isinstance(c, str) for c in value):
            raise GrammarError(field, "must be a non-empty list of strings")
        # A Lark rule of string literals (JSON's quoting is Lark's).
        return Grammar(field, llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in value)))
    from llguidance.gbnf_to_lark import any_to_lark

    try:  # Lark, llguidance's own format, or GBNF (llama.cpp's, xgrammar's), which it converts to Lark
        text = any_to_lark(_source(field, value, str))
    except GrammarError:
        raise
    except Exception as error:
        raise GrammarError(field, f"invalid grammar: {_first_lines(str(error))}") from None
    return Grammar(field, llguidance.LLMatcher.grammar_from_lark(text))


def options_grammar(opts, prompts: int) -> "list[Grammar | None] | None":
    """The grammar ``--options`` asks for (``guided_json``/``guided_grammar``: a file;
    ``guided_regex``; ``guided_choice``: |-separated), for each of ``prompts``, or None."""
    from pathlib import Path

    given = {name: getattr(opts, name) for name in FIELDS[1:] if getattr(opts, name, None) is not None}
    if not given:
        return None
    fields = {}
    for name, value in given.items():
        if name in ("guided_json", "guided_grammar"):
            try:
                value = Path(value).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise GrammarError(name, f"cannot read {value!r}: {getattr(error, 'strerror', None) or error}") from None
        elif name == "guided_choice":
            value = value.split("|")
        fields[name] = value
    return [grammar_from_fields(**fields)] * prompts


class Compiler:
    """Grammars against one tokenizer (``batch.BloomTokenizer``; ``vocab_size``: the model's,
    which may pad the tokenizer's: padding tokens are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        # Reading a vocabulary of BLOOM's size takes about 2 s: once per tokenizer (``for_tokenizer``).
        self.tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                eos_token=tokenizer.eos_token_id)
        self.vocab_size = vocab_size
        self.eos = tokenizer.eos_token_id
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, grammar: Grammar) -> None:
        """Compile (or find) ``grammar``; a ``GrammarError`` naming its field if the library refuses it."""
        self.matcher(grammar)

    def matcher(self, grammar: Grammar):
        """A fresh matcher for one row (a copy of the grammar's cached one)."""
        import llguidance

        with self._lock:
            cached = self._cache.get(grammar.text)
            if cached is not None:
                self._cache.move_to_end(grammar.text)
                return cached.deep_copy()
        error = llguidance.LLMatcher.validate_grammar(grammar.text, self.tokenizer, limits=_limits())
        if error and not error.startswith("WARNING"):
            raise GrammarError(grammar.field, _first_lines(error))
        matcher = llguidance.LLMatcher(self.tokenizer, grammar.text, limits=_limits(), log_level=0)
        if matcher.is_error():
            raise GrammarError(grammar.field, _first_lines(matcher.get_error()))
        with self._lock:
            self._cache[grammar.text] = matcher
            while len(self._cache) > CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher.deep_copy()


def _first_lines(error: str) -> str:
    return " ".join(line.strip() for line in error.strip().splitlines()[:4])[:500]


_COMPILERS: "weakref.WeakKeyDictionary[object, dict[int, Compiler]]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def for_tokenizer(tokenizer, vocab_size: int) -> Compiler:
    """The one ``Compiler`` of a tokenizer and vocabulary size (built on first use)."""
    with _COMPILERS_LOCK:
        per_size = _COMPILERS.setdefault(tokenizer, {})
        if vocab_size not in per_size:
            per_size[vocab_size] = Compiler(tokenizer, vocab_size)
        return per_size[vocab_size]


def mask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class RowGrammar:
    """One row's grammar, on the server and in the offline loop alike: its matcher, its next mask
    ([1, words] int32 on the host, computed once per token, ideally while the device decodes), the
    tokens it has taken and whether it ended (the matcher stopped: nothing but the end may follow)."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.mask = torch.empty((1, mask_words(vocab_size)), dtype=torch.int32)
        self.ready = False
        self.consumed = 0
        self.ended = False

    def prepare(self) -> torch.Tensor:
        """The row's allowed tokens now (computed if not yet)."""
        import llguidance.torch as llt

        if not self.ready:
            llt.fill_next_token_bitmask(self.matcher, self.mask, 0)
            self.ready = True
        return self.mask

    def consume(self, token: int) -> bool:
        """The row chose ``token``; True when that ended its grammar."""
        self.matcher.consume_token(token)
        self.consumed += 1
        self.ready = False
        self.ended = self.matcher.is_stopped() or self.matcher.is_error()
        return self.ended

    def masks_ahead(self, guesses: list[int], out: torch.Tensor) -> list[bool]:
        """Speculation's masks: ``out[j]`` (``out`` [len(guesses) + 1, words] int32) the row's
        allowed tokens had it chosen ``guesses[:j]``; returns for each position j whether its
        grammar had ended before it (the loop ends the row there, as it does after ``consume``).
        The matcher is advanced over the guesses and rolled back: it is left as it was. Past a
        guess the grammar refuses (or after its end) every token is allowed: that guess cannot
        be accepted, so those positions are never kept."""
        import llguidance.torch as llt

        out[0] = self.prepare()[0]
        ended = [self.ended]
        taken = 0
        for j, token in enumerate(guesses, start=1):
            # try_consume_tokens takes nothing it refuses (consume_token would enter an error state).
            if ended[-1] or self.matcher.try_consume_tokens([token]) != 1:
                break
            taken += 1
            llt.fill_next_token_bitmask(self.matcher, out, j)
            ended.append(self.matcher.is_stopped() or self.matcher.is_error())
        if taken:
            self.matcher.rollback(taken)  # exactly what was taken: rolling back more breaks the matcher
        out[len(ended):] = -1
        return ended + [False] * (len(guesses) + 1 - len(ended))


class GrammarRows:
    """The grammars of a batch's ``rows`` rows for the offline loop: a ``RowGrammar`` per
    constrained row (None: unconstrained), gathered into a host bitmask [rows, words] int32
    (pinned where a card will read it) and its device copy."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        pin = self.device.type == "cuda"
        self.host = torch.full((rows, mask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)
        self.rows: list[RowGrammar | None] = [None] * rows

    def set(self, row: int, matcher) -> None:
        self.rows[row] = RowGrammar(matcher, self.vocab_size) if matcher is not None else None

    def clear(self, row: int) -> None:
        self.set(row, None)
        self.host[row].fill_(-1)

    @property
    def consumed(self) -> list[int]:
        """Tokens each row's grammar has taken (0 without one)."""
        return [g.consumed if g is not None else 0 for g in self.rows]

    @property
    def ended(self) -> list[bool]:
        return [g is not None and g.ended for g in self.rows]

    def any(self, count: int | None = None) -> bool:
        return any(g is not None for g in self.rows[:count])

    def masks(self, count: int | None = None) -> torch.Tensor:
        """The allowed tokens of rows 0..count-1 as the device's [count, words] int32: each
        constrained row's mask; unconstrained rows keep every bit."""
        count = len(self.rows) if count is None else count
        for row, grammar in enumerate(self.rows[:count]):
            if grammar is not None:
                self.host[row] = grammar.prepare()[0]
        return self.host[:count].to(self.device, non_blocking=True)

    def advance(self, tokens: list[int]) -> list[int]:
        """Each constrained row's chosen token into its grammar; returns the rows whose grammar
        ended with it."""
        return [row for row, (grammar, token) in enumerate(zip(self.rows, tokens))
                if grammar is not None and not grammar.ended and grammar.consume(token)]

    def masks_ahead(self, guesses: list[list[int]], counts: list[int]) -> tuple[torch.Tensor, list[list[bool]]]:
        """Speculation's masks of every verified position: host [rows * S, words] int32 (row-major,
        S = len(guesses[0]) + 1; each row's first ``counts[r]`` guesses followed, see
        ``RowGrammar.masks_ahead``; every bit set for unconstrained rows) and, per row and
        position, whether its grammar had ended before it."""
        s = len(guesses[0]) + 1 if guesses else 1
        masks = torch.full((len(self.rows) * s, self.host.shape[1]), -1, dtype=torch.int32)
        ended = [[False] * s for _ in self.rows]
        for row, grammar in enumerate(self.rows):
            if grammar is not None:
                ahead = grammar.masks_ahead(guesses[row][: counts[row]], masks[row * s : row * s + counts[row] + 1])
                ended[row][: len(ahead)] = ahead
        return masks, ended


def _bias_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where its bit i is set and -inf where not (little-endian
    bit order: token t is bit t % 8 of byte t // 8). Made at every call (a few ops on 2 KB), so
    lazy mode on a Gaudi sees the same graph every step."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return torch.where(bits == 1, 0.0, float("-inf")).to(dtype)


def allowed(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool (on the masks' device)."""
    bias = torch.nn.functional.embedding(masks.view(torch.uint8).long(), _bias_table(torch.float32, masks.device))
    return bias.view(masks.shape[0], -1)[:, :vocab_size] == 0


def allow(scores: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """``scores`` [rows, V] with -inf where ``masks`` [rows, words] forbids a token: the bitmask's
    bytes look up their 8 bits' biases (0 or -inf) and the bias is added (x + 0 is x). On 2 cores
    this takes 2.6 ms for [16, 250880] where unpacking bits to bools and ``masked_fill`` take 24."""
    bias = torch.nn.functional.embedding(masks.view(torch.uint8).long(), _bias_table(scores.dtype, scores.device))
    return scores + bias.view(masks.shape[0], -1)[:, : scores.shape[-1]]
