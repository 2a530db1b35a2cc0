"""Record a step's operations once, then replay exactly those operations on exactly those tensors.

This is what a captured graph is, on an HPU (``HPUGraph``) and on CUDA (``torch.cuda.CUDAGraph``):
capture runs the step once and keeps the work it did; a replay redoes that work on the memory the
capture used, whatever Python code would do now. So, as on a card:

* inputs are the tensors the capture read: a caller's new values reach the step only if they were
  copied into them;
* outputs are the tensors the capture wrote, overwritten by every replay: an output kept across the
  next replay changes under the caller's feet;
* Python values (an int, a shape, a branch taken) are frozen at their capture-time values.

``Recording`` is a ``TorchDispatchMode``: every ATen call made while it is active is kept with its
arguments and results. ``replay()`` walks the list: an op that only makes a view is skipped (the
captured view still aliases the captured tensor), an op that writes into its arguments is run
again on them, and an op that makes a new tensor is run again and its result copied into the tensor
it made at capture (fixed addresses, like a graph's memory pool).

While capturing, ``GraphRules`` refuses what a runtime cannot capture (``CaptureRefused``):
host syncs and data-dependent shapes (both runtimes), in-place writes into views (HPU graphs),
random ops without a graph-safe generator (CUDA graphs).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# While a graph is captured or replayed on this thread, the lazy-mode tracker (lazy.py) ignores
# the ops: they belong to the graph, not to the eager lazy graph around it.
IN_GRAPH = threading.local()


def in_graph() -> bool:
    return getattr(IN_GRAPH, "depth", 0) > 0


class _GraphScope:
    def __enter__(self):
        IN_GRAPH.depth = getattr(IN_GRAPH, "depth", 0) + 1

    def __exit__(self, *exc):
        IN_GRAPH.depth -= 1


class CaptureRefused(RuntimeError):
    """Something a captured graph cannot hold (the runtime would fail, or silently freeze a value)."""


class ViewWriteInGraph(CaptureRefused):
    """An in-place write into a view while capturing an HPU graph (HPU graphs do not support it)."""


class HostSyncInGraph(CaptureRefused):
    """A host read of device data (``.item()``, ``.tolist()``, ``.cpu()``, a data-dependent shape)."""


class RandomOpInGraph(CaptureRefused):
    """A random op captured without a graph-safe generator (CUDA graphs)."""


# Ops whose output shape depends on tensor values: the host must read the device to size them.
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                  "argwhere", "nonzero_static"}
RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli", "bernoulli_",
          "multinomial", "normal", "normal_", "uniform_", "exponential_", "random_", "cauchy_", "geometric_",
          "log_normal_", "randperm", "native_dropout"}
HOST_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def op_name(func) -> str:
    return func._schema.name.split("::")[-1]


def written_arguments(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op writes into (its schema marks them ``(a!)``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, torch.Tensor)]
    return written


def returns_view(func) -> bool:
    """The op's results alias its inputs without writing them (view, transpose, narrow, unbind...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def writes_in_place(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


@dataclass(frozen=True)
class GraphRules:
    """What a capture refuses. ``view_writes``: HPU graphs; ``random``: CUDA graphs."""

    view_writes: bool = False
    random: bool = False

    def check(self, func, args, kwargs) -> None:
        name = op_name(func)
        if name == "_local_scalar_dense":
            raise HostSyncInGraph(f"{func} reads a device value on the host while capturing a graph")
        if name in DATA_DEPENDENT or (name == "index" and _has_bool_index(args)):
            raise HostSyncInGraph(f"{func} has a data-dependent output shape (a host sync) while capturing a graph")
        if self.random and name in RANDOM:
            raise RandomOpInGraph(f"{func} draws random numbers while capturing a CUDA graph")
        if self.view_writes:
            for target in written_arguments(func, args, kwargs):
                if target._is_view():
                    raise ViewWriteInGraph(f"{func} writes in place into a view of shape {tuple(target.shape)} "
                                           "while capturing an HPU graph")


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


class _NoHostReads(TorchFunctionMode):
    """Host reads that never reach the dispatcher on CPU tensors (``.cpu()`` of a CPU tensor is the
    tensor itself; ``.tolist()`` of an empty one reads nothing), refused by name."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            raise HostSyncInGraph(f"Tensor.{name}() reads device data on the host while capturing a graph")
        if name == "to" and any(_to_host(a) for a in list(args[1:]) + list((kwargs or {}).values())):
            raise HostSyncInGraph("Tensor.to('cpu') copies device data to the host while capturing a graph")
        return func(*args, **(kwargs or {}))


def _to_host(value) -> bool:
    return (isinstance(value, str) and value.startswith("cpu")) or (isinstance(value, torch.device) and value.type == "cpu")


@dataclass
class _Op:
    func: object
    args: tuple
    kwargs: dict
    out: object
    kind: str  # "view" (skipped at replay), "inplace" (run again), "new" (run again, copied into out)


class Recording(TorchDispatchMode):
    """One captured graph: ``with recording: out = step(*inputs)``, then ``recording.replay()``."""

    def __init__(self, rules: GraphRules):
        super().__init__()
        self.rules = rules
        self.ops: list[_Op] = []
        self._host_reads = _NoHostReads()
        self._scope = _GraphScope()

    def __enter__(self):
        self._scope.__enter__()
        self._host_reads.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._host_reads.__exit__(*exc)
            self._scope.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.rules.check(func, args, kwargs)
        out = func(*args, **kwargs)
        kind = "view" if returns_view(func) else "inplace" if writes_in_place(func) else "new"
        self.ops.append(_Op(func, args, kwargs, out, kind))
        return out

    @torch.no_grad()
    def replay(self) -> None:
        with self._scope:
            for op in self.ops:
                if op.kind == "view":
                    continue
                fresh = op.func(*op.args, **op.kwargs)
                _wait_for_collectives(fresh)  # a graph's collectives are done before its next op
                if op.kind == "new":
                    for captured, value in zip(_tensors(op.out), _tensors(fresh)):
                        captured.copy_(value)

    @property
    def op_count(self) -> int:
        return len(self.ops)


def _wait_for_collectives(value) -> None:
    """c10d ops return a Work handle beside their tensors; eager code waits on it at once."""
    for item in value if isinstance(value, (list, tuple)) else [value]:
        if hasattr(item, "wait") and not isinstance(item, torch.Tensor):
            item.wait()


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
