"""One request inside the engine (``RequestHandle``: its events, its cancellation), the host state
of each of its rows while it runs (``Row``), and the errors a submit raises."""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

from ..search.text_ends import IncrementalText
from .params import Event, SamplingParams


class EngineError(ValueError):
    """A request the engine cannot take (prompt too long, too many rows...); message for the user,
    ``param`` the request field it is about."""

    def __init__(self, message: str, param: str = "prompt"):
        super().__init__(message)
        self.param = param


class QueueFull(Exception):
    """The engine's queue holds ``max_queue`` requests already."""


ENGINE_STOPPED = "engine_stopped"  # the code of the 503 a stopped engine's server answers (the front door reads it)


class EngineStopped(Exception):
    """The engine's thread ended on an error (its warm-up failed, or something no step catches):
    nothing it holds or is sent will be answered."""


_ids = itertools.count(1)


class RequestHandle:
    """One request inside the engine. Events go to ``sink`` (called from the scheduler thread), or,
    without one, to a queue read by ``events()``. ``cancel()`` frees its rows at the next step."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, sink=None, offline=None):
        self.id = next(_ids)
        self.prompt_ids = prompt_ids
        self.params = params
        self.offline = offline  # a requests.Request for the batch runner's path (Engine.submit_offline), or None
        self.cancelled = threading.Event()
        self.submitted = time.perf_counter()
        self.first_token_at: float | None = None
        self._queue: queue.Queue | None = queue.Queue() if sink is None else None
        self._sink = sink or self._queue.put
        self.sequences: dict[int, object] = {}  # choice index -> finished Sequence
        self.cached_tokens = 0  # prompt tokens the prefix cache served

    def emit(self, event: Event) -> None:
        try:
            self._sink(event)
        except Exception:  # a consumer that is gone (e.g. its event loop closed): stop its rows
            self.cancel()

    def cancel(self) -> None:
        self.cancelled.set()

    def events(self, timeout: float | None = None):
        """Events until the last one ("done", "record" or "error"); only without a sink."""
        while True:
            event = self._queue.get(timeout=timeout)
            yield event
            if event.kind in ("done", "record", "error"):
                return

    def result(self, timeout: float | None = None) -> list:
        """The finished sequences, by choice index (blocks; only without a sink)."""
        for event in self.events(timeout):
            if event.kind == "error":
                raise EngineError(event.message)
        return [self.sequences[i] for i in sorted(self.sequences)]


@dataclass
class Row:
    """Host state of one row of a request (looked up by identity, ``is``: rows are dataclasses)."""

    handle: RequestHandle
    indices: list[int]  # the choices this row answers (greedy: all n of them)
    prompt_len: int
    limit: int  # new tokens it may produce
    out: IncrementalText  # its text so far (EOS excluded) and how much was sent
    ids: list[int] = field(default_factory=list)
    ids_given: int = 0  # token ids already sent
    pending: list = field(default_factory=list)  # TokenLogprob of ids not yet sent
    last_time: float = 0.0
    # Joining in chunks: prompt tokens in this row's slots so far (prompt_len once it runs), and
    # for a request's other rows, its first row, whose slots they take when its prompt is complete.
    prompt_done: int = 0
    copy_of: "Row | None" = None
    grammar: object = None  # structured.RowGrammar: its matcher, when its request has a grammar
    guess_budget: object = None  # speculating.Budget: the guesses it may offer a pass (--speculate)
    draft: object = None  # drafting.RowDraft: what the draft model's cache holds of it (--speculate draft)

    @property
    def running(self) -> bool:
        return self.prompt_done >= self.prompt_len

    @property
    def written(self) -> int:
        """Slots of its row written so far (at most)."""
        return self.prompt_len + len(self.ids) if self.running else self.prompt_done
