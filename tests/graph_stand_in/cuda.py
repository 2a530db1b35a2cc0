"""CUDA graphs as PyTorch makes them (``torch.cuda.CUDAGraph``, ``torch.cuda.graph``), run on the CPU.

``install(patch)`` replaces the few ``torch.cuda`` names the CUDA backend uses with stand-ins:
``is_available`` says yes, streams and devices are contexts that record which device they were
made for, and a ``CUDAGraph`` captures with a ``Recording`` (graph_stand_in/recording.py) and
replays its recorded ops. Captures refuse host syncs, data-dependent shapes and random ops (PyTorch's
CUDA-graph notes: no sync, static shapes, RNG only through a registered generator). Graph memory is
kept as on a card: a graph's outputs are the tensors its capture made, overwritten by each replay.

Streams and capture contexts remember the device index they were made on, so a test can check that
one process on ``cuda:N`` never captures on device 0 (``STATE.devices_used``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from .recording import GraphRules, Recording

CUDA_RULES = GraphRules(random=True)


@dataclass
class State:
    graphs: list = field(default_factory=list)  # every CUDAGraph captured
    current_device: int = 0
    devices_used: set = field(default_factory=set)  # device indices streams/captures were made on
    synchronizes: int = 0


STATE = State()


def _index(device) -> int:
    if device is None:
        return STATE.current_device
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return device.index if device.index is not None else STATE.current_device


class Stream:
    def __init__(self, device=None, priority=0):
        self.device_index = _index(device)
        STATE.devices_used.add(self.device_index)

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


_CURRENT = Stream.__new__(Stream)
_CURRENT.device_index = 0


def current_stream(device=None) -> Stream:
    _CURRENT.device_index = _index(device)
    return _CURRENT


@contextlib.contextmanager
def stream(s):
    yield s


class device:  # noqa: N801  (torch.cuda.device is a class used as a context)
    def __init__(self, index):
        self.index = _index(index)

    def __enter__(self):
        self.previous, STATE.current_device = STATE.current_device, self.index
        return self

    def __exit__(self, *exc):
        STATE.current_device = self.previous


def set_device(index) -> None:
    STATE.current_device = _index(index)


class CUDAGraph:
    def __init__(self):
        self.recording: Recording | None = None
        self.device_index = None

    def capture_begin(self, pool=None, capture_error_mode="global"):
        self.device_index = STATE.current_device
        STATE.devices_used.add(self.device_index)
        self.recording = Recording(CUDA_RULES)
        self.recording.__enter__()

    def capture_end(self):
        self.recording.__exit__(None, None, None)
        STATE.graphs.append(self)

    def replay(self):
        self.recording.replay()


class graph:  # noqa: N801  (torch.cuda.graph is a context-manager class)
    def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        self.cuda_graph = cuda_graph
        self.pool = pool
        self.stream = stream
        self.capture_error_mode = capture_error_mode

    def __enter__(self):
        self.cuda_graph.capture_begin(self.pool, self.capture_error_mode)

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.cuda_graph.capture_end()
        else:
            self.cuda_graph.recording.__exit__(kind, value, tb)


def synchronize(device=None) -> None:
    STATE.synchronizes += 1


def install(patch) -> State:
    """``patch(obj, name, value)``: pytest's ``monkeypatch.setattr`` or a plain ``setattr``."""
    global STATE
    STATE = State()
    cuda = torch.cuda
    patch(cuda, "is_available", lambda: True)
    patch(cuda, "current_device", lambda: STATE.current_device)
    patch(cuda, "device_count", lambda: 8)
    patch(cuda, "Stream", Stream)
    patch(cuda, "stream", stream)
    patch(cuda, "current_stream", current_stream)
    patch(cuda, "device", device)
    patch(cuda, "set_device", set_device)
    patch(cuda, "CUDAGraph", CUDAGraph)
    patch(cuda, "graph", graph)
    patch(cuda, "graph_pool_handle", lambda: ("pool",))
    patch(cuda, "synchronize", synchronize)
    return STATE
