"""Where a row's text ends: at its first EOS token, or just before its first stop string.

Every caller asks here, so that they agree: the sequences of every search (``results.make_sequence``),
the loop's stop check every few steps (``stopping.StopChecker``), and streaming, which also needs
to know how much of a row still being generated it may give out (``safe_length``). Text after an
EOS never counts: stop strings are looked for in the text before it.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class TextEnd:
    text: str  # decoded up to the first EOS, cut just before the first stop string
    token_ids: list[int]  # the ids that spell it: up to and including an EOS, or just enough to cover the text
    reason: str | None  # "eos", "stop", or None: nothing ended the row (yet)


def before_eos(ids: list[int], eos_token_id: int) -> tuple[list[int], bool]:
    """The ids whose text counts (those before the first EOS), and whether an EOS came."""
    if eos_token_id in ids:
        return ids[: ids.index(eos_token_id)], True
    return ids, False


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where ``text`` ends because of a stop string: the start of the stop string completed first
    (of those completed by the same character, the one that starts first), or None.

    Earliest end rather than earliest start: a row's text must not depend on how many tokens the
    loop ran past a stop before it checked (every few steps), nor differ from what streaming gave
    out as soon as the stop was complete. The two differ only when one stop string holds another
    past its first character ("abcd" and "bc": "bc" always ends the text first)."""
    hits = [(at + len(s), at) for s in stops if (at := text.find(s)) >= 0]
    return min(hits)[1] if hits else None


def text_end(ids: list[int], stops: list[str], tokenizer, eos_ends: bool = True) -> TextEnd:
    """Cut a row's generated ids at its first EOS or stop string, whichever ends the text first
    (``eos_ends=False``: at a stop string only; EOS is left out of the text)."""
    text_ids, eos = before_eos(ids, tokenizer.eos_token_id) if eos_ends else (ids, False)
    text = tokenizer.decode(text_ids)
    cut = first_stop(text, stops)
    if cut is None:
        return TextEnd(text, ids[: len(text_ids) + 1] if eos else ids, "eos" if eos else None)
    # The shortest id prefix whose text covers everything before the stop string. Its last token
    # may also hold the start of the stop string; the text is cut exactly regardless.
    keep = next(n for n in range(len(text_ids) + 1) if len(tokenizer.decode(text_ids[:n])) >= cut)
    return TextEnd(text[:cut], ids[:keep], "stop")


def safe_length(text: str, stops: list[str], finished: bool = False) -> int:
    """How much of a row's text (its EOS already cut off) may be given out now: up to its first stop
    string; all of it once the row is finished; otherwise all but the longest tail that the next
    tokens could still complete into a stop string."""
    cut = first_stop(text, stops)
    if cut is not None:
        return cut
    if finished or not stops:
        return len(text)
    for held in range(min(len(text), max(map(len, stops)) - 1), 0, -1):
        if any(s.startswith(text[-held:]) for s in stops):
            return len(text) - held
    return len(text)


class IncrementalText:
    """One row's text as its tokens arrive, and how much of it may be given out so far: the one
    incremental detokenizer of streaming (``generation/run/streaming.py``) and the server's engine.

    Tokens are decoded byte by byte (a UTF-8 character may span tokens); ``take()`` hands out the
    text past what was given, held back where a stop string could still begin (``safe_length``).
    The caller keeps EOS out (``before_eos``): what follows it is never text."""

    def __init__(self, token_bytes, stops: list[str]):
        self.token_bytes = token_bytes  # id -> bytes (logprobs.TokenText.token_bytes)
        self.stops = stops
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""  # decoded so far
        self.given = 0  # characters of text already handed out

    def add(self, token_id: int) -> None:
        self.text += self.decoder.decode(self.token_bytes(token_id))

    @property
    def stopped(self) -> bool:
        """The text holds a stop string."""
        return first_stop(self.text, self.stops) is not None

    def take(self, finished: bool = False) -> str:
        """The text that may be given out now and was not yet (``finished``: the row has ended)."""
        safe = safe_length(self.text, self.stops, finished=finished)
        piece = self.text[self.given : safe] if safe > self.given else ""
        self.given = max(self.given, safe)
        return piece

    @property
    def all_given(self) -> bool:
        return self.given == len(self.text)
