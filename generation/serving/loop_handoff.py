"""The hand-off from the engine's thread to the server's event loop.

Every ``call_soon_threadsafe`` wakes the loop by writing to its self-pipe, a system call in the
engine's thread. A step hands out an event per running row, so ``Mailbox`` collects the events
and wakes the loop once per batch; ``drain`` lets the engine wait, briefly, until the loop has
sent what it was given.
"""

from __future__ import annotations

import asyncio
import threading

DRAIN_S = 0.02  # the most a step waits for the event loop to send the last step's tokens


class Mailbox:
    """Puts items into asyncio queues of one loop from another thread, in batches: the first item
    of a batch schedules one delivery, the items posted before it runs go with it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def post(self, queue: asyncio.Queue, item) -> None:
        """Raises RuntimeError when the loop is closed (the consumer is gone)."""
        if self.loop.is_closed():
            raise RuntimeError("the event loop is closed")
        with self._lock:
            self._pending.append((queue, item))
            first = len(self._pending) == 1
        if first:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            items, self._pending = self._pending, []
        for queue, item in items:
            queue.put_nowait(item)


def drain(loop: asyncio.AbstractEventLoop) -> None:
    """Wait (from the engine's thread, at most DRAIN_S) until ``loop`` has run what was queued so
    far and the tasks that woke: the tokens of a step are on their way to the clients. On a small
    CPU, the loop's work beside a decode step slows the step's threads by more than the work itself
    takes; on a card the engine waits here while the decode it launched runs."""
    done = threading.Event()
    loop.call_soon_threadsafe(lambda: loop.call_soon(done.set))
    done.wait(DRAIN_S)
