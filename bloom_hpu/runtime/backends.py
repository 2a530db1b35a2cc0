"""Device backends: where the steps run, how they are captured, and which shapes they saw.

Every step goes through ``Backend.run(step, *inputs)``, where ``step`` is a small module (see
``steps.py``) whose tensors besides ``inputs`` (weights, KV cache) never move. The backend records
the step's shape signature, so tests and the CLI can count distinct shapes, and then:

* ``cpu``: runs it eagerly (optionally through ``torch.compile``);
* ``cuda``: captures it once per signature as a ``torch.cuda.CUDAGraph`` and replays it;
* ``hpu``: runs it wrapped by Habana's ``wrap_in_hpu_graph`` and ends each step with
  ``mark_step()``. Habana's modules are imported lazily: nothing here needs them on CPU or CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ..quantize import dequantize_in_products
from . import hpu_env
from .cpu import CpuOptions, CpuPlan, accelerate


class DeviceError(Exception):
    """The requested device cannot be used here (one line for the user)."""


def hpu_available() -> bool:
    return importlib.util.find_spec("habana_frameworks") is not None


def default_device() -> str:
    if hpu_available():
        return "hpu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def signature(name: str, step, inputs) -> tuple:
    """(step name, input shapes and dtypes, the step's own fixed shapes such as cache and window)."""
    return (name, tuple((tuple(t.shape), str(t.dtype)) for t in inputs), getattr(step, "static_shape", ()))


class Backend:
    """Eager execution with shape bookkeeping; the base of the other backends."""

    name = "cpu"
    # The KV cache's layout for this backend (kv_cache.py): one 5-D tensor (False) or one tensor per
    # layer written whole (True, for HPU graphs).
    per_layer_cache = False
    # A prefill may stop at the longest real prompt (``steps.real_span``, a host read of the
    # lengths): where prefill runs eagerly (CPU, and CUDA, where only decode steps are captured),
    # not on a Gaudi, where the prefill is a graph and every new shape a new compile.
    trim_prefill = True
    # Step shapes that change every token (``static_shapes=False``: the window grows) are fine
    # where steps run eagerly; a graph runtime would capture one graph per token.
    graphs_every_shape = False
    # Eager ops between steps are compiled, per sequence of ops and shapes (lazy mode on a Gaudi):
    # callers then prefer one fixed sequence of ops to skipping the ones a batch does not need.
    compiles_eager_ops = False
    # A step returns once it is queued, before the device has run it (a card): host work placed
    # after the launch runs while the device computes. On the CPU a step is done when it returns.
    asynchronous_steps = False

    def __init__(self, device: str = "cpu", use_graphs: bool = True, compile_steps: bool = False,
                 cpu: CpuOptions = CpuOptions()):
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.compile_steps = compile_steps
        self.cpu_options = cpu
        self.cpu_plan: CpuPlan | None = None  # set by prepare_model on the CPU
        self.signatures: set[tuple] = set()

    @property
    def fast_path(self) -> str:
        """The CPU fast path in words (``cpu/accelerate.py``), or 'none' off the CPU."""
        return self.cpu_plan.description if self.cpu_plan is not None else "none"

    def graph_count(self) -> int:
        """Graphs captured (the original scripts printed this as hpu_graphs); where nothing is
        captured (the CPU), the distinct step signatures run, each compiled once by
        ``torch.compile`` when that is on."""
        return len(self.signatures)

    def signatures_of(self, name: str) -> set[tuple]:
        return {s for s in self.signatures if s[0] == name}

    def prepare(self, step: torch.nn.Module) -> torch.nn.Module:
        """Hook for backends that wrap a step module once when it is created."""
        return step

    def prepare_model(self, model) -> None:
        """Once per model: on the CPU, its fast path (``cpu/accelerate.py``)."""
        self.cpu_plan = accelerate(model, self.cpu_options, self.compile_steps)

    def check_static(self, static_shapes: bool) -> None:
        """Refuse, in one line, a run whose step shapes would change every token on a runtime
        that captures every shape."""
        if not static_shapes and self.use_graphs and self.graphs_every_shape:
            raise DeviceError(f"static_shapes=false grows the attention window every token, which on {self.name} "
                              "would capture a new graph per token; run it with --use_graphs f")

    def run(self, name: str, step, *inputs: torch.Tensor):
        self.signatures.add(signature(name, step, inputs))
        plan = self.cpu_plan
        if name == "decode" and plan is not None and plan.decode is not None and inputs[0].shape[0] <= plan.decode_rows:
            # The CPU's one-call step (cpu/accelerate.py); more rows run op by op, through oneDNN.
            tokens, positions = inputs
            return plan.decode(tokens, positions, step.cache, step.window)
        if name == "mixed" and plan is not None and plan.decode is not None:
            taken = plan.decode.computed_tokens(*inputs)
            if int(taken.sum()) <= plan.mixed_rows:  # the same call, with the segments' tokens
                return plan.decode.mixed(*inputs, step.cache, step.window, taken)
        if name == "verify" and plan is not None and plan.decode is not None and inputs[0].numel() <= plan.mixed_rows:
            # Speculation's verify pass: its B * S tokens are a mixed step's tokens (each at its own
            # slot, attending its row up to there), so the one call runs it too.
            ids, starts = inputs
            return plan.decode.verify(ids, starts, step.cache, step.window)
        if name == "verify_mixed" and plan is not None and plan.decode is not None:
            taken = plan.decode.verified_tokens(*inputs)
            if int(taken.sum()) <= plan.mixed_rows:
                return plan.decode.verify_mixed(*inputs, step.cache, step.window, taken)
        if self.compile_steps and name == "decode":
            fn = step.__dict__.get("compiled")
            if fn is None:
                # dynamic=False: one specialised graph per shape, as on the accelerators. On CPU,
                # freezing (weights as constants, prepacked for oneDNN) and a C++ wrapper (less
                # host time per kernel) are what make it pay off: without them the compiled step
                # is slower than eager.
                options = {"freezing": True, "cpp_wrapper": True} if self.device.type == "cpu" else None
                fn = step.__dict__["compiled"] = torch.compile(step, dynamic=False, fullgraph=True, options=options)
            return fn(*inputs)
        return step(*inputs)

    def synchronize(self) -> None:
        pass

    def mark_step(self) -> None:
        """End a unit of eager device work (lazy mode on a Gaudi compiles the ops queued since the
        last one as one graph): called at fixed points between steps, so each unit is one kind of
        work with a few shapes, compiled once, whatever order a server interleaves them in."""


class CudaBackend(Backend):
    """Decode steps (and the server's mixed ones, a decode carrying a prompt chunk) captured as CUDA
    graphs, one per (step module, signature), then replayed.

    Following PyTorch's CUDA-graph notes:

    * capturing records the addresses of every tensor the step touches: the step's weights and
      cache never move, and its inputs are copied into static buffers before each replay;
    * the output is a static buffer too, overwritten by the next replay of the same graph: callers
      consume it before then (the search loops and the engine read logits once per step);
    * warm-up runs and captures happen on a side stream of the step's own device (``cuda:N``, not
      the current device), under ``torch.cuda.device`` of it;
    * under tensor parallelism the graphs hold NCCL collectives: before a capture every queued
      collective has finished (synchronize, then a barrier), and the capture runs in
      ``thread_local`` error mode, so NCCL's watchdog thread polling events of earlier work cannot
      invalidate it (PyTorch made the watchdog's own polls thread-local in 2.7; older releases need
      the capture side to do it);
    * graphs live on their step module, so they go when the step goes (``release_caches``), and a
      recycled object id can never replay a graph into freed memory.
    """

    name = "cuda"
    graphs_every_shape = True
    asynchronous_steps = True

    def __init__(self, device: str = "cuda", use_graphs: bool = True, compile_steps: bool = False, cpu=None):
        if not torch.cuda.is_available():
            raise DeviceError("--device cuda was asked for, but no CUDA device is available")
        super().__init__(device, use_graphs, compile_steps)
        # The card this backend's streams and captures belong to (the current one for a bare 'cuda').
        self.cuda_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self.tensor_parallel = False
        self.tp_group = None
        self.captured = 0  # graphs captured so far
        self.quantized_kernels = False  # whether quantized decode products run our Triton kernels
        # One memory pool for every captured graph: steps replay one after another and each output
        # is consumed before the next replay, so graphs can share their scratch memory instead of
        # each holding its own (the original's HPU graphs multiplied memory this way).
        self._pool = None

    def prepare_model(self, model) -> None:
        """No CPU fast path: a card runs the model's own operations, except that quantized weights'
        products of a few rows (decode) go through our Triton kernels where Triton is installed and
        a probe product on the card agrees with the public ops (``cuda_quantized.py``)."""
        self.tensor_parallel = model.parallel.world_size > 1
        self.tp_group = getattr(model.parallel, "group", None)  # with data parallelism: this replica's ranks
        dequantize_in_products(model)
        self.quantized_kernels = False
        try:
            from . import cuda_quantized
        except ImportError:  # no Triton: the public ops serve every product
            return
        self.quantized_kernels = cuda_quantized.install(model, model.word_embeddings_layernorm.weight.dtype)

    def graph_count(self) -> int:
        return self.captured

    def run(self, name: str, step, *inputs: torch.Tensor):
        # The steps of every token (verify, verify_mixed: speculation's).
        if not self.use_graphs or name not in ("decode", "mixed", "verify", "verify_mixed"):
            return super().run(name, step, *inputs)
        sig = signature(name, step, inputs)
        self.signatures.add(sig)
        graphs = step.__dict__.setdefault("cuda_graphs", {})
        entry = graphs.get(sig)
        if entry is None:
            entry = graphs[sig] = self._capture(step, inputs)
            self.captured += 1
        graph, static_inputs, static_output = entry
        for buffer, value in zip(static_inputs, inputs):
            buffer.copy_(value)
        graph.replay()
        return static_output

    def _capture(self, step, inputs):
        static_inputs = [t.clone() for t in inputs]
        with torch.cuda.device(self.cuda_index):
            # Warm up on a side stream (lazy initialisation must not happen during capture). A decode
            # step only writes the cache slots it was given, with the values it computes from them, so
            # running it with the real inputs before the real replay is harmless.
            side = torch.cuda.Stream(device=self.cuda_index)
            side.wait_stream(torch.cuda.current_stream(self.cuda_index))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step(*static_inputs)
            torch.cuda.current_stream(self.cuda_index).wait_stream(side)
            mode = "global"
            if self.tensor_parallel:
                torch.cuda.synchronize(self.cuda_index)
                torch.distributed.barrier(group=self.tp_group)
                mode = "thread_local"
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=mode):
                static_output = step(*static_inputs)
        return graph, static_inputs, static_output

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.cuda_index)


# Graphs each wrapped step may keep (Habana's ``max_graphs``; past it the bridge runs a new input
# layout eagerly). A step module serves one input signature (steps.py makes one per cache and
# window), so it captures one graph; the bound only keeps memory finite if some caller ever feeds
# a new input layout each call.
HPU_MAX_GRAPHS = 4


class HpuBackend(Backend):
    """Gaudi: steps wrapped in HPU graphs (one per input layout, cached by the bridge), each step
    ended by ``mark_step``, following Habana's inference rules:

    * the environment (``hpu_env``) is set before the bridge is imported; a bridge imported earlier
      without it, or without lazy mode, is a ``DeviceError``;
    * each step module gets inputs of one layout (fresh tensors, see the search loops), and the
      cache is written whole with ``index_copy_`` (``KVCache(per_layer=True)``): HPU graphs do not
      support in-place writes into views;
    * every integer a step or the loop computes fits int32 (lazy mode computes int64 as int32;
      ``PT_ENABLE_INT64_SUPPORT`` is documented for eager and compile modes only);
    * graphs keep no intermediate tensors between replays (``disable_tensor_cache``): a step's
      output is consumed before the next replay;
    * the prefill (first token) runs without a graph when ``graph_prefill`` is off (Habana's
      ``--limit_hpu_graphs``): its [B, H, P, P] scores would stay allocated with the graph. That is
      the default under tensor parallelism, where the 176B model leaves little memory.
    """

    name = "hpu"
    per_layer_cache = True
    trim_prefill = False
    graphs_every_shape = True
    compiles_eager_ops = True
    asynchronous_steps = True

    def __init__(self, device: str = "hpu", use_graphs: bool = True, compile_steps: bool = False, cpu=None,
                 graph_prefill: bool | None = None):
        late = hpu_env.set_defaults(use_graphs)
        if late:
            raise DeviceError(hpu_env.late_message(late))
        try:
            import habana_frameworks.torch.core as htcore  # noqa: F401  (registers the hpu device)
            import habana_frameworks.torch.hpu as hthpu
        except ImportError as error:
            raise DeviceError(f"--device hpu was asked for, but Habana's PyTorch bridge is missing ({error})")
        if use_graphs and not hasattr(hthpu, "wrap_in_hpu_graph"):
            raise DeviceError("HPU graphs need lazy mode: Habana's bridge was imported without "
                              f"PT_HPU_LAZY_MODE=1 (it is {os.environ.get('PT_HPU_LAZY_MODE')!r}); "
                              "set it before starting, or run with --use_graphs f")
        super().__init__(device, use_graphs, compile_steps=False)
        self.graph_prefill = graph_prefill  # None: yes on one card, no under tensor parallelism
        self.captured = 0  # HPU graphs captured so far
        self._htcore = htcore
        self._hthpu = hthpu

    def prepare_model(self, model) -> None:
        """Once per model, its weights on the device. No CPU fast path here, even when a test runs
        this backend on the CPU: a Gaudi runs the model's own operations."""
        if self.graph_prefill is None:
            self.graph_prefill = model.parallel.world_size == 1
        dequantize_in_products(model)

    def prepare(self, step: torch.nn.Module) -> torch.nn.Module:
        first_token = getattr(step, "runs_prompts", False)
        if not self.use_graphs or (first_token and not self.graph_prefill):
            return step
        step.__dict__["hpu_graph"] = True
        return self._hthpu.wrap_in_hpu_graph(step, disable_tensor_cache=True, max_graphs=HPU_MAX_GRAPHS)

    def graph_count(self) -> int:
        return self.captured

    def run(self, name: str, step, *inputs: torch.Tensor):
        sig = signature(name, step, inputs)
        self.signatures.add(sig)
        if step.__dict__.get("hpu_graph"):
            # The bridge captures a new input layout of a wrapped step, up to its max_graphs.
            seen = step.__dict__.setdefault("graph_signatures", set())
            if sig not in seen and len(seen) < HPU_MAX_GRAPHS:
                seen.add(sig)
                self.captured += 1
        out = step(*inputs)
        self._htcore.mark_step()
        return out

    def mark_step(self) -> None:
        self._htcore.mark_step()

    def synchronize(self) -> None:
        self._hthpu.synchronize()


def make_backend(device: str | None = None, use_graphs: bool = True, compile_steps: bool = False,
                 cpu: CpuOptions = CpuOptions(), graph_prefill: bool | None = None) -> Backend:
    """The backend for ``device`` ('cpu', 'cuda', 'cuda:1', 'hpu'; None: the best available).
    ``cpu``: the CPU fast path's options (used on the CPU only). ``graph_prefill``: HPU only (see
    ``HpuBackend``)."""
    device = device or default_device()
    kind = device.split(":")[0]
    if kind == "cpu":
        return Backend("cpu", use_graphs, compile_steps, cpu)
    if kind == "cuda":
        return CudaBackend(device, use_graphs, compile_steps)
    if kind == "hpu":
        return HpuBackend(device, use_graphs, graph_prefill=graph_prefill)
    raise DeviceError(f"unknown device {device!r}: choose cpu, cuda or hpu")
