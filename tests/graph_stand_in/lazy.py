"""Lazy mode's eager ops, hashed the way the bridge caches their compiled graphs.

In lazy mode every op outside an HPU graph is only queued; ``mark_step()`` (or a host read, or the
next graph) ends the queue, and the bridge compiles it into a "lazy graph" unless one with the same
hash was compiled before. The hash covers each op, its input shapes and dtypes, the strides and
storage offsets of views, and its scalar arguments: so ``out[step] = token`` (a view at a new offset
every token), or a Python ``step`` multiplied into a tensor, is a new compile every token.

``LazyTracker`` is a ``TorchDispatchMode`` that keeps the current queue's op signatures and, at each
boundary, adds the queue's hash to ``graphs``. Tests assert that the set stops growing after
warm-up. It also enforces lazy mode's integer rule: int64 tensors are computed as int32 (Habana's
``PT_ENABLE_INT64_SUPPORT`` is documented for eager and torch.compile modes only), so an int64
value outside the int32 range is refused (``Int64InLazyMode``) instead of silently wrapping.

Dispatch modes are per thread: the tracker enters itself on each thread that runs steps (the
server's scheduler thread too) at that thread's first ``mark_step``.
"""

from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .recording import in_graph, op_name

INT32 = (-(1 << 31), (1 << 31) - 1)
HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2"}


class Int64InLazyMode(RuntimeError):
    """An int64 value that does not fit int32, which lazy mode would compute wrongly."""


def _describe(value):
    if isinstance(value, torch.Tensor):
        view = (value.stride(), value.storage_offset()) if value._is_view() else ()
        return ("T", tuple(value.shape), str(value.dtype), view)
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format)):
        return value
    return type(value).__name__


class LazyTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.graphs: dict[int, tuple] = {}  # hash -> the ops of every lazy graph compiled so far
        self.compiles = 0  # lazy graphs compiled (distinct hashes)
        self.flushes = 0
        self._queues: dict[int, list] = {}  # per thread
        self._entered = threading.local()
        self._lock = threading.Lock()
        self.active = True  # False once the test that made it is over (it may stay on a thread's stack)

    # -- threads ------------------------------------------------------------------------------

    def ensure_entered(self) -> None:
        """Track this thread's ops from now on (a mode is per thread; it stays entered)."""
        if not getattr(self._entered, "yes", False):
            self._entered.yes = True
            self.__enter__()

    def close(self) -> None:
        """Stop tracking (the test is over); leave this thread's mode stack."""
        self.active = False
        if getattr(self._entered, "yes", False):
            self._entered.yes = False
            self.__exit__(None, None, None)

    # -- the queue ----------------------------------------------------------------------------

    def _queue(self) -> list:
        return self._queues.setdefault(threading.get_ident(), [])

    def flush(self) -> None:
        """A boundary: the queued ops become one lazy graph (compiled if its hash is new)."""
        queue = self._queue()
        if not queue:
            return
        ops = tuple(queue)
        key = hash(ops)
        queue.clear()
        with self._lock:
            self.flushes += 1
            if key not in self.graphs:
                self.graphs[key] = ops
                self.compiles += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.active:
            return out
        name = op_name(func)
        uninitialised = name.startswith(("empty", "new_empty"))  # garbage until written
        for t in (out if isinstance(out, (list, tuple)) and not uninitialised else [] if uninitialised else [out]):
            if isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.numel():
                low, high = int(t.min()), int(t.max())
                if low < INT32[0] or high > INT32[1]:
                    raise Int64InLazyMode(f"{func} makes int64 values up to {max(abs(low), high)}, outside int32: "
                                          "lazy mode computes int64 as int32")
        if in_graph():
            return out
        self._queue().append((name, _describe(args), _describe(tuple(sorted(kwargs.items())))))
        if name in HOST_SYNC_OPS:
            self.flush()  # the host waits for the queue to run
        return out
