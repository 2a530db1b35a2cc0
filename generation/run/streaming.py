"""Streaming: text pieces of one prompt's continuation, as the loop produces them.

``Generator.stream(prompt, ...)`` runs an ordinary ``generate`` call (same static shapes, same
graphs) in a worker thread and watches the token loop through its ``on_step`` hook. The hook only
keeps a reference to each step's token tensor, which costs no synchronisation; every
``copy_every`` steps the pending tokens go to the host in one copy (on the CPU after every step,
since a copy there is free; on accelerators every 4 steps, the one sync that printing needs).

``generate_streaming`` does the same on the calling thread, handing each piece to a callback as it
comes (the chat shell, which stops a reply on Ctrl-C at a step boundary).

The pieces always join to exactly ``generate(prompt, ...)[0].text``: text stops at the first EOS,
text that may be the start of a stop string is held back until it is known not to be one, and
the last piece is whatever the finished result adds to what was already given out.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from .logprobs import TokenText
from ..search.stopping import normalize_stops
from ..search.text_ends import IncrementalText, before_eos

_DONE = object()


class _Cancelled(Exception):
    """The consumer stopped iterating: end the generation early."""


class _TokenWatcher:
    """The loop's ``on_step`` hook for row 0: turns tokens into text and hands it to ``emit``."""

    def __init__(self, tokenizer, stops: list[str], copy_every: int, emit, cancelled: threading.Event):
        self.out = IncrementalText(TokenText(tokenizer).token_bytes, stops)
        self.eos = tokenizer.eos_token_id
        self.copy_every = copy_every
        self.emit = emit
        self.cancelled = cancelled
        self.pending: list[torch.Tensor] = []
        self.ended = False  # EOS or a stop string was seen: nothing more to give out

    @property
    def given(self) -> int:
        return self.out.given

    @property
    def text(self) -> str:
        return self.out.text

    def __call__(self, tokens: torch.Tensor, done: torch.Tensor) -> None:
        if self.cancelled.is_set():
            raise _Cancelled
        self.pending.append(tokens[:1])  # a view of row 0: no copy, no sync
        if len(self.pending) >= self.copy_every:
            self.flush()

    def flush(self) -> None:
        if not self.pending or self.ended:
            self.pending.clear()
            return
        ids = torch.cat(self.pending).tolist()  # the one host copy of these steps
        self.pending.clear()
        ids, self.ended = before_eos(ids, self.eos)
        for t in ids:
            self.out.add(t)
        self.ended = self.ended or self.out.stopped
        piece = self.out.take(finished=self.ended)
        if piece:
            self.emit(piece)


def _generate_watched(generator, prompt: str, options, stops: list[str], watcher: _TokenWatcher):
    result = generator.generate([prompt], options, stop=stops or None, on_step=watcher)[0]
    watcher.flush()
    # The finished result is the truth; whatever it adds to the pieces is the last one.
    if result.text[: watcher.given] == watcher.text[: watcher.given] and len(result.text) > watcher.given:
        watcher.emit(result.text[watcher.given :])
    return result


def generate_streaming(generator, prompt: str, options, emit, stop=None, copy_every: int | None = None,
                       cancelled: threading.Event | None = None):
    """Generate ``prompt``'s continuation on the calling thread, handing ``emit`` the same pieces
    ``stream_text`` yields, as they come; returns the GenerationResult, or None when ``cancelled``
    was set: the loop then ends at its next step boundary (never inside a step or a graph capture).

    No worker thread: the caller keeps its thread (the chat shell sets ``cancelled`` from its
    Ctrl-C handler), and no torch per-thread state is left to be torn down while the process exits,
    which can abort the exit of a short-lived shell."""
    stops = normalize_stops(stop)
    if copy_every is None:
        copy_every = 1 if generator.device.type == "cpu" else 4
    watcher = _TokenWatcher(generator.tokenizer, stops, copy_every, emit, cancelled or threading.Event())
    try:
        return _generate_watched(generator, prompt, options, stops, watcher)
    except _Cancelled:
        watcher.flush()  # what the steps before the stop produced, still held back at a possible marker
        return None


def stream_text(generator, prompt: str, options, stop=None, copy_every: int | None = None,
                on_result=None) -> Iterator[str]:
    """Iterate over text pieces of ``prompt``'s continuation (see the module doc)."""
    if not isinstance(prompt, str):
        raise TypeError("stream takes one prompt (a string)")
    stops = normalize_stops(stop)
    if copy_every is None:
        copy_every = 1 if generator.device.type == "cpu" else 4
    pieces: queue.Queue = queue.Queue()
    cancelled = threading.Event()
    watcher = _TokenWatcher(generator.tokenizer, stops, copy_every, pieces.put, cancelled)

    def work():
        try:
            result = _generate_watched(generator, prompt, options, stops, watcher)
            if on_result is not None:
                on_result(result)
            pieces.put(_DONE)
        except _Cancelled:
            pieces.put(_DONE)
        except BaseException as error:  # re-raised in the consumer's thread
            pieces.put(error)

    thread = threading.Thread(target=work, name="bloom-stream", daemon=True)
    thread.start()
    try:
        while True:
            item = pieces.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        cancelled.set()
        thread.join()
