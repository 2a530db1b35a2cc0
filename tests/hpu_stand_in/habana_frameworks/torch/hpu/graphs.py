"""HPU graphs as the bridge caches them, run on the CPU.

``wrap_in_hpu_graph`` swaps a module's ``forward`` for a cache of graphs keyed on its inputs. Each
tensor contributes its shape, dtype, strides, storage offset and whether it is a view: a view with
a new offset (``slots[step]``) is a new key, hence a new capture, every time. A capture runs the
module under ``NoViewWrites``, which refuses what HPU graphs do not support: in-place writes into
views. A replay runs the module again (on the CPU it gives what the graph would).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GRAPH_CACHES: list["GraphCache"] = []  # every wrapped module's cache, in wrapping order


class ViewWriteInGraph(RuntimeError):
    """An in-place write into a view inside a captured graph (not supported by HPU graphs)."""


def input_key(obj):
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape), obj.dtype, obj.stride(), obj.storage_offset(), obj._is_view())
    if isinstance(obj, (list, tuple)):
        return tuple(input_key(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, input_key(v)) for k, v in sorted(obj.items()))
    return obj


def written_arguments(func, args, kwargs):
    """The tensors an operation writes into (its schema marks them ``(a!)``)."""
    written = []
    for i, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written += [v for v in values if isinstance(v, torch.Tensor)]
    return written


class NoViewWrites(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for target in written_arguments(func, args, kwargs):
            if target._is_view():
                raise ViewWriteInGraph(f"{func} writes in place into a view of shape {tuple(target.shape)} "
                                       "while capturing an HPU graph")
        return func(*args, **kwargs)


class GraphCache:
    def __init__(self, forward, max_graphs: int | None, name: str):
        self.forward = forward
        self.max_graphs = max_graphs
        self.name = name
        self.graphs: OrderedDict = OrderedDict()  # key -> True, oldest first
        self.keys: list = []  # every key captured, in order (evicted ones too)
        self.captures = self.replays = self.evictions = 0

    def __call__(self, *args, **kwargs):
        key = input_key((args, kwargs))
        if key in self.graphs:
            self.graphs.move_to_end(key)
            self.replays += 1
            return self.forward(*args, **kwargs)
        with NoViewWrites():
            out = self.forward(*args, **kwargs)
        self.captures += 1
        self.keys.append(key)
        self.graphs[key] = True
        if self.max_graphs is not None and len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
            self.evictions += 1
        return out


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    cache = GraphCache(module.forward, max_graphs, type(module).__name__)
    module.forward = cache
    GRAPH_CACHES.append(cache)
    return module
