"""Progress of long work on stderr (request jobs, evaluation, warm-up), through tqdm.

On a terminal it is tqdm's live bar: done / total, the rate, the time left. Anywhere else (a log
file, a pipe, a CI job) a bar redrawn with carriage returns would fill the file with half lines, so
it prints a plain line at most every ``LINE_EVERY`` seconds instead, and a last one at the end if it
printed any: a long job leaves a readable trail, a short one prints nothing. Callers turn it off
for ``--quiet`` and on tensor-parallel ranks other than 0.
"""

from __future__ import annotations

import sys
import time

from tqdm import tqdm

LINE_EVERY = 30.0  # seconds between plain lines when stderr is not a terminal
LINE_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def log(message: str) -> None:
    """One line on stderr; a live bar there is cleared first and drawn again below it."""
    tqdm.write(message, file=sys.stderr)
    sys.stderr.flush()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """``total`` items of work called ``unit`` (plural), shown as ``desc``; use as a context manager."""

    def __init__(self, total: int, desc: str, unit: str, *, enabled: bool = True, stream=None,
                 every: float | None = None, delay: float = 0.0):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.unit = total, desc, " " + unit
        self.every = LINE_EVERY if every is None else every
        live = enabled and _is_terminal(self.stream)
        self.lines = enabled and not live
        # ``delay``: the live bar appears only once the work has taken that long (a short one shows none).
        self.bar = tqdm(total=total, desc=desc, unit=self.unit, file=self.stream, disable=not live,
                        dynamic_ncols=True, delay=delay)
        self.n, self.postfix = 0, ""
        self.start = self.last_line = time.perf_counter()
        self.printed_n: int | None = None  # items done at the last plain line

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def update(self, n: int = 1, postfix: str = "") -> None:
        """``n`` more items done; ``postfix``: anything else to show, e.g. "52.1 tokens/s"."""
        self.n += n
        self.postfix = postfix or self.postfix
        if not self.bar.disable:
            if postfix:
                self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(n)
        elif self.lines and time.perf_counter() - self.last_line >= self.every:
            self._line()

    def close(self) -> None:
        self.bar.close()
        if self.lines and self.printed_n is not None and self.printed_n != self.n:
            self._line()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _line(self) -> None:
        line = tqdm.format_meter(self.n, self.total, self.elapsed, prefix=self.desc, unit=self.unit,
                                 postfix=self.postfix or None, bar_format=LINE_FORMAT)
        self.stream.write(line + "\n")
        self.stream.flush()
        self.last_line, self.printed_n = time.perf_counter(), self.n
