"""Where the shell's lines come from: the keyboard, and under tensor parallelism rank 0's keyboard.

Every rank of a tensor-parallel run must generate each reply (each holds a slice of the model), so
every rank must see each typed line. Rank 0 alone reads the terminal and broadcasts each line, as
bytes, to the others; end of input (Ctrl-D) is broadcast too, so every rank leaves together.

While the user thinks, the other ranks wait inside a broadcast, and a collective that waits past
the process group's timeout (``BLOOM_COLLECTIVE_TIMEOUT``, 30 minutes by default) fails. So rank 0
reads the terminal in a thread and, while no line has come, broadcasts an empty heartbeat every
``HEARTBEAT_SECONDS``, or a quarter of the timeout when that is shorter.
"""

from __future__ import annotations

import queue
import sys
import threading

import torch

HEARTBEAT_SECONDS = 60.0
_EOF, _HEARTBEAT = -1, -2  # lengths that carry no text


def use_line_editing() -> None:
    """Arrow keys and a history of typed lines at the prompt, where the platform has readline."""
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (input() uses it once imported)
        except ImportError:
            pass


class KeyboardLines:
    """One process: ``input()``; None at end of input."""

    def read(self, prompt: str) -> str | None:
        try:
            return input(prompt)
        except EOFError:
            return None


class BroadcastLines:
    """Rank 0 reads the keyboard; every rank gets the same lines (see the module doc)."""

    def __init__(self, parallel, keyboard: KeyboardLines | None = None, heartbeat: float | None = None):
        self.parallel = parallel
        self.device = getattr(parallel, "device", "cpu")  # nccl and hccl take device tensors
        self.keyboard = keyboard or KeyboardLines()
        if heartbeat is None:
            from bloom_hpu.runtime.launch import collective_timeout

            heartbeat = min(HEARTBEAT_SECONDS, collective_timeout() / 4)
        self.heartbeat = heartbeat
        self._typed: queue.Queue = queue.Queue()

    def read(self, prompt: str) -> str | None:
        if self.parallel.rank != 0:
            return self._receive()
        reader = threading.Thread(target=lambda: self._typed.put(self.keyboard.read(prompt)), daemon=True)
        reader.start()
        while True:
            try:
                line = self._typed.get(timeout=self.heartbeat)
            except queue.Empty:
                self._send(_HEARTBEAT, b"")
                continue
            data = b"" if line is None else line.encode("utf-8", errors="surrogateescape")
            self._send(_EOF if line is None else len(data), data)
            return line

    def _send(self, length: int, data: bytes) -> None:
        torch.distributed.broadcast(torch.tensor([length], dtype=torch.int64, device=self.device), src=0)
        if length > 0:
            payload = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
            torch.distributed.broadcast(payload, src=0)

    def _receive(self) -> str | None:
        while True:
            length = torch.empty(1, dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(length, src=0)
            n = int(length.item())
            if n == _HEARTBEAT:
                continue
            if n == _EOF:
                return None
            payload = torch.empty(n, dtype=torch.uint8, device=self.device)
            if n:
                torch.distributed.broadcast(payload, src=0)
            return bytes(payload.cpu().tolist()).decode("utf-8", errors="surrogateescape")


def line_source(parallel):
    return KeyboardLines() if parallel.world_size <= 1 else BroadcastLines(parallel)
