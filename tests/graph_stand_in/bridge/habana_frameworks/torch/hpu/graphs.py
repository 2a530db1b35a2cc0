"""HPU graphs as the bridge makes them (``habana_frameworks/torch/hpu/graphs.py``), run on the CPU.

``wrap_in_hpu_graph`` swaps a module's ``forward`` for a cache of graphs keyed on its inputs, as
the bridge's ``input_hash`` does: each tensor contributes its shape and view hash (whether it is a
view, and a view's strides and storage offset; not its dtype), any other argument its value. A new key is a capture: the
module runs once while a ``Recording`` keeps its ops, and the call's own input tensors become the
graph's inputs. A known key is a replay: the new inputs are copied into those captured tensors, the
recorded ops run again, and the captured outputs are returned (the same tensors every replay). Once
``max_graphs`` keys are held a new key runs the module eagerly, uncaptured, as the bridge does.
Captures refuse in-place writes into views, host syncs and data-dependent shapes.
"""

from __future__ import annotations

import torch

from graph_stand_in.recording import GraphRules, Recording, ViewWriteInGraph  # noqa: F401

from ... import torch as bridge

GRAPH_CACHES: list["GraphCache"] = []  # every wrapped module's cache, in wrapping order
HPU_RULES = GraphRules(view_writes=True)


def input_key(obj):
    if isinstance(obj, torch.Tensor):  # the view hash: a plain tensor's strides and dtype do not count
        view = (obj.stride(), obj.storage_offset()) if obj._is_view() else ()
        return ("tensor", tuple(obj.shape), obj._is_view(), view)
    if isinstance(obj, (list, tuple)):
        return tuple(input_key(o) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, input_key(v)) for k, v in sorted(obj.items()))
    return obj


def copy_into(captured, given) -> None:
    if isinstance(captured, torch.Tensor):
        captured.copy_(given)
    elif isinstance(captured, (list, tuple)):
        for c, g in zip(captured, given):
            copy_into(c, g)
    elif isinstance(captured, dict):
        for key in captured:
            copy_into(captured[key], given[key])


class GraphCache:
    def __init__(self, forward, max_graphs: int | None, name: str, disable_tensor_cache: bool):
        self.forward = forward
        self.max_graphs = max_graphs
        self.name = name
        self.disable_tensor_cache = disable_tensor_cache
        self.graphs: dict = {}  # key -> (recording, captured inputs, captured outputs)
        self.keys: list = []  # every key captured, in order
        self.captures = self.replays = self.eager_calls = 0

    def __call__(self, *args, **kwargs):
        if kwargs.pop("bypass_hpu_graphs", False):
            self.eager_calls += 1
            return self.forward(*args, **kwargs)
        bridge.lazy_boundary()  # the queued eager ops run before the graph
        key = input_key((args, kwargs))
        entry = self.graphs.get(key)
        if entry is not None:
            recording, inputs, outputs = entry
            copy_into(inputs, (args, kwargs))
            recording.replay()
            self.replays += 1
            return outputs
        if self.max_graphs is not None and len(self.graphs) >= self.max_graphs:
            self.eager_calls += 1
            return self.forward(*args, **kwargs)
        recording = Recording(HPU_RULES)
        with recording:
            outputs = self.forward(*args, **kwargs)
        self.graphs[key] = (recording, (args, kwargs), outputs)
        self.keys.append(key)
        self.captures += 1
        return outputs


def wrap_in_hpu_graph(module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None):
    cache = GraphCache(module.forward, max_graphs, type(module).__name__, disable_tensor_cache)
    module.forward = cache
    module.clear_cache = cache.graphs.clear
    GRAPH_CACHES.append(cache)
    return module
