"""Choosing and applying the CPU fast path of a finished model.

``accelerate(model, options)`` picks, from what this CPU and this torch build can do
(``capability.py``) and what ``CpuOptions`` allow, one of:

* our kernels for the CPU's ISA (``kernels.py``: AVX512-BF16, or AVX2+FMA+F16C): the products of a
  few rows (on a CPU with AMX, bf16 products of many rows too, on its tiles), and in one process
  the whole decode step and a prefill's attention as one call each;
* oneDNN (PyTorch's private mkldnn operations, used only where a probe call showed they work):
  bf16 weights packed in oneDNN's layout, the MLP's GELU inside its product;
* PyTorch's public operations alone (other architectures, or ``path='plain'``);

and within that, the route of prompts (per bucket of rows) and of decode rows, timed on this CPU
once (``choose_routes``: ``routes.py`` names the candidates, ``choice.py`` times and caches them):
bf16/fp16 products or fp32 ones on the widened weight (``WidenedProducts``) or the few-rows kernel
for a prompt's many rows; weight-only or integer products (``int8_activations.py``) for a
quantized model's prompts and decode rows apart.

It swaps the model's layers for their CPU variants (``layers.py``) and returns a ``CpuPlan``: what
was chosen and why (for the load line and the benchmark), and the one-call decode step, if any.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ...model import Attention, StaticBloom, segment_layout
from ...int8_activations import MODES as INT8_ACTIVATIONS_MODES
from ...int8_activations import Int8ActivationsError, check_rows
from ...quantize import (INT8_KERNEL_FLOAT_ROWS, INT8_KERNEL_MANY_ROWS, INT8_KERNEL_ROWS, quantized_mode, quantized_products,
                        use_int8_activations)
from . import capability, choice, routes
from .huge_pages import huge_bytes, model_tensors, move_weights
from .integer_rows import choose_integer_rows
from .kernels import Kernels, KernelsUnavailable, load
from .prefetch import choose_prefetch
from .layers import (AMX_MIN_ROWS, AMX_TILE_ROWS, CPU_LINEAR, FEW_ROWS, FEW_ROWS_AMX, CpuTiedHead, KernelGelu,
                     OneCallPromptAttention, WidenedProducts, kernel_suits, swap, unswap)

PATHS = ("auto", "avx512_bf16", "avx2", "onednn", "plain")


class CpuPathError(Exception):
    """The CPU path asked for cannot run here (one line for the user)."""


@dataclass(frozen=True)
class CpuOptions:
    """``path``: 'auto' (the fastest this CPU can run), a kernel build ('avx512_bf16', 'avx2': an
    error where it cannot run), 'onednn' (no kernels) or 'plain' (PyTorch's public operations only).
    ``one_call_steps``: with kernels, the decode step and a prefill's attention as one C++ call each.
    ``pack_weights``: without kernels, bf16 weights packed for oneDNN.
    ``amx``: with the AVX-512 kernels on a CPU with AMX-BF16, their bf16 products of 4 rows or
    more on AMX tiles (off: the AVX-512 loop, as on other CPUs; a setting of the process, as the
    kernels are loaded once per process).
    ``widen``: the products of many rows over bf16/fp16 and quantized weights in fp32 on the
    widened weight may be chosen (off: never, to compare).
    ``int8_activations``: for quantized weights, 'auto' (integer products where measured faster,
    for prompts and decode rows apart), 'on' (every product: what ``--int8_activations on`` sets on the
    model before the runtime sees it) or 'off' (weight-only products).
    ``choice``: how the routes of ``routes.py`` are chosen: 'measure' (timed on this CPU once,
    cached), 'static' (the rule of thumb, no timing), or forced pairs 'prompts=widened,decode=integer'
    (``choice.py``); None: ``$BLOOM_CPU_CHOICE``, else 'measure'.
    ``huge_pages``: the weights moved into transparent huge pages where Linux offers them
    (``huge_pages.py``; off: where they were loaded, to compare)."""

    path: str = "auto"
    one_call_steps: bool = True
    pack_weights: bool = True
    amx: bool = True
    widen: bool = True
    int8_activations: str = "auto"
    choice: str | None = None
    huge_pages: bool = True

    def __post_init__(self):
        if self.path not in PATHS:
            raise CpuPathError(f"unknown CPU path {self.path!r}: choose one of {', '.join(PATHS)}")
        if self.int8_activations not in INT8_ACTIVATIONS_MODES:
            raise CpuPathError(f"unknown int8_activations {self.int8_activations!r}: choose one of "
                               f"{', '.join(INT8_ACTIVATIONS_MODES)}")
        try:
            choice.check(self.choice)
        except choice.ChoiceError as error:
            raise CpuPathError(str(error)) from None


@dataclass
class CpuPlan:
    """What ``accelerate`` chose. ``decode``: the one-call decode step (``OneCallDecode``) or None,
    for steps of at most ``decode_rows`` rows (more run op by op, where oneDNN takes the products),
    and for the server's mixed steps of at most ``mixed_rows`` tokens (``OneCallDecode.mixed``)."""

    description: str
    kernels: Kernels | None = None
    decode: Callable | None = None
    decode_rows: int = FEW_ROWS
    mixed_rows: int = FEW_ROWS  # the most tokens (those it computes) of a mixed step through ``decode.mixed``
    prompt_attention: list[Attention] = field(default_factory=list)

    def drop_one_call_decode(self, why: str) -> None:
        """Decode op by op from now on (the one-call step computes the plain model only)."""
        if self.decode is not None:
            self.decode = None
            self.description = self.description.replace("one-call decode step", f"decode op by op ({why})")

    @contextmanager
    def op_by_op(self):
        """Within it, the one-call steps are off and the steps run op by op from Python, as on the
        other devices: to compare the two."""
        decode, self.decode = self.decode, None
        for attention in self.prompt_attention:
            unswap(attention)
        try:
            yield self
        finally:
            self.decode = decode
            for attention in self.prompt_attention:
                swap(attention, OneCallPromptAttention)


class OneCallDecode:
    """The model's ``decode`` as one call of ``csrc/decode_step.cpp``: the same computation and
    roundings without ~120 Python-dispatched operations per step (for a small model, most of it).
    With ``op_quantized`` the step reads the model's int8 or int4 weights and their scales
    (``bloom_hpu/quantize.py``) through ``decode_step_quantized``; with ``integer``, as integer
    products (``bloom_hpu/int8_activations.py``)."""

    def __init__(self, model: StaticBloom, op: Callable, op_quantized: Callable | None = None, integer: bool = False):
        self.weights, scales = decode_weights(model)
        self.scales = scales if op_quantized is not None else None
        self.op = op if op_quantized is None else \
            (lambda w, *rest: op_quantized(w, self.scales, *rest, integer=integer))
        self.eps = model.config.layer_norm_epsilon
        self.residual_from_ln = model.config.apply_residual_connection_post_layernorm

    def __call__(self, tokens, positions, cache, window: int) -> torch.Tensor:
        """The model's ``decode``; logits [B, V]. The op leaves out the rows at slot 0 (``idle_rows``:
        their logits are zeros, which nothing reads), deciding in C++ from the positions it reads
        anyway, so the token loop keeps no host read per step."""
        return self.op(self.weights, tokens, positions, cache.keys, cache.values, cache.alibi, window, self.eps,
                       self.residual_from_ln)

    def mixed(self, tokens, positions, chunk, chunk_rows, chunk_start, chunk_len, cache, window: int,
              taken: torch.Tensor | None = None) -> torch.Tensor:
        """The model's ``mixed`` (a decode step with prompt segments [S, C]) as the same one call: each
        real segment token is one more token of the step, in its prompt's cache row at its own slot.
        Returns logits [B + S, V], as the model's, but zeros for a joining row's filler token and the
        rows at slot 0 (see ``computed_tokens``), which nothing reads. ``taken``: ``computed_tokens``
        of these inputs, where the caller has it already (the backend, which routes on its count)."""
        b, (s, c) = tokens.shape[0], chunk.shape
        chunk_slots, keep = segment_layout(b, chunk_start, chunk_len, c, cache)
        if taken is None:
            taken = computed_tokens(positions, chunk, chunk_rows, chunk_start, chunk_len)
        ids = torch.cat([tokens[:, 0], chunk.reshape(-1)])[taken]
        slots = torch.cat([positions, chunk_slots.reshape(-1)])[taken]
        rows = torch.cat([cache.rows[:b], chunk_rows.repeat_interleave(c)])[taken]
        # keep counts among all B + S*C tokens; ``place`` maps it to the taken ones. A repeated
        # segment's last token is not taken, and maps to the last one taken before it: the last
        # token of the segment it repeats, whose logits it returns.
        place = taken.cumsum(0) - 1
        returned = torch.cat([taken[:b], torch.ones(s, dtype=torch.bool)])  # [B + S]: all but fillers
        logits = self.op(self.weights, ids, slots, cache.keys, cache.values, cache.alibi, window, self.eps,
                         self.residual_from_ln, rows, place[keep[returned]])
        if bool(returned.all()):
            return logits
        out = logits.new_zeros(b + s, logits.shape[1])
        out[returned] = logits
        return out

    def verify(self, ids, starts, cache, window: int) -> torch.Tensor:
        """The model's ``verify`` (ids [B, S] from slots ``starts`` [B]) as the same one call: position
        j of row b is one more token of the step, in cache row b at slot starts[b] + j (clamped to the
        cache, as the model clamps it), attending its row's slots up to its own. Logits [B, S, V].
        One pass over the weights for all B * S tokens, the plain decode's products and roundings:
        a guess the target accepts gets the logits a decode step would have given it."""
        b, s = ids.shape
        tokens, slots, rows = verify_positions(ids, starts, cache)
        logits = self.op(self.weights, tokens, slots, cache.keys, cache.values, cache.alibi, window, self.eps,
                         self.residual_from_ln, rows, torch.arange(b * s))
        return logits.view(b, s, -1)

    def verify_mixed(self, ids, starts, chunk, chunk_rows, chunk_start, chunk_len, cache, window: int,
                     taken: torch.Tensor | None = None) -> torch.Tensor:
        """The model's ``verify_mixed`` (a verify of ids [B, S] with prompt segments [G, C]) as the same
        one call: the rows' B * S tokens as in ``verify``, then the segments' real tokens as in
        ``mixed``, in that order (a segment's write comes after the rows'). Logits [B*S + G, V]."""
        n, c = ids.numel(), chunk.shape[1]
        row_tokens, row_slots, row_rows = verify_positions(ids, starts, cache)
        chunk_slots, _ = segment_layout(0, chunk_start, chunk_len, c, cache)
        if taken is None:
            taken = self.verified_tokens(ids, starts, chunk, chunk_rows, chunk_start, chunk_len)
        tokens = torch.cat([row_tokens, chunk.reshape(-1)])[taken]
        slots = torch.cat([row_slots, chunk_slots.reshape(-1)])[taken]
        rows = torch.cat([row_rows, chunk_rows.repeat_interleave(c)])[taken]
        place = taken.cumsum(0) - 1  # as in ``mixed``: a repeated segment's end maps to the one it repeats
        segment_ends = n - 1 + chunk_len + c * torch.arange(chunk.shape[0])
        keep = torch.cat([torch.arange(n), segment_ends])
        return self.op(self.weights, tokens, slots, cache.keys, cache.values, cache.alibi, window, self.eps,
                       self.residual_from_ln, rows, place[keep])

    @staticmethod
    def verified_tokens(ids, starts, chunk, chunk_rows, chunk_start, chunk_len) -> torch.Tensor:
        """Which of ``verify_mixed``'s B*S + G*C tokens the one call computes: every row's, and the
        segments' real tokens (not their pads, nor a segment that repeats the one before)."""
        return torch.cat([torch.ones(ids.numel(), dtype=torch.bool), segment_tokens(chunk, chunk_rows, chunk_start,
                                                                                    chunk_len).reshape(-1)])

    @staticmethod
    def computed_tokens(tokens, positions, chunk, chunk_rows, chunk_start, chunk_len) -> torch.Tensor:
        """``computed_tokens`` for ``mixed``'s inputs: the tokens it computes (its cost follows their count)."""
        return computed_tokens(positions, chunk, chunk_rows, chunk_start, chunk_len)


def idle_rows(positions: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of a decode whose token goes to slot 0. A generated token always follows at
    least one prompt token, so a row at slot 0 generates nothing: a free row of the server's batch,
    or one whose prompt has not begun (the engine gives those slot 0). Its key and value land in a
    slot that the row's next occupant or first segment writes before anything reads it, and nobody
    reads its logits, so the one-call steps leave it out (op by op, it runs with the rest)."""
    return positions == 0


def computed_tokens(positions, chunk, chunk_rows, chunk_start, chunk_len) -> torch.Tensor:
    """Which of a mixed step's B + S*C tokens the one call computes ([B + S*C] bool). Not:
    * a joining row's filler: the decode token of a row that a segment of this step continues, at
      the slot where that segment starts (``engine.py``), so the segment overwrites its key and
      value, and its logits are not used (the row's first token comes from its last segment);
    * a row at slot 0 (``idle_rows``);
    * the pad tokens past a segment's length, and the segments that repeat the one before to pad
      their count (``DeviceRows.mixed``): they only write slots that nothing reads before a real
      token writes them again (a prompt's real tokens end before the cache's last slot, where pad
      tokens past its end are clamped).
    The op-by-op step computes them all, its shapes being fixed for graphs; the one call takes any
    number of tokens. At a burst's start most rows are joining: most of a step's decode tokens are
    fillers."""
    b, (s, c) = positions.shape[0], chunk.shape
    filler = ((chunk_rows[:, None] == torch.arange(b)[None, :]) & (chunk_start[:, None] == positions[None, :])).any(0)
    filler |= idle_rows(positions)
    return torch.cat([~filler, segment_tokens(chunk, chunk_rows, chunk_start, chunk_len).reshape(-1)])


def verify_positions(ids, starts, cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A verify pass's ids [B, S] as one-call tokens: (ids, slots, cache rows), each [B*S], row-major;
    position j of row b at slot starts[b] + j, clamped to the cache as the model clamps it."""
    b, s = ids.shape
    slots = (starts[:, None] + cache.slots[None, :s]).clamp(max=cache.length - 1)
    return ids.reshape(-1), slots.reshape(-1), cache.rows[:b].repeat_interleave(s)


def segment_tokens(chunk, chunk_rows, chunk_start, chunk_len) -> torch.Tensor:
    """[S, C] bool: the real tokens of prompt segments [S, C]: not the pads past a segment's length,
    nor the segments that repeat the one before to pad their count (``DeviceRows.mixed``)."""
    s, c = chunk.shape
    repeated = torch.zeros(s, dtype=torch.bool)
    repeated[1:] = (chunk_rows[1:] == chunk_rows[:-1]) & (chunk_start[1:] == chunk_start[:-1])
    return (torch.arange(c)[None, :] < chunk_len[:, None]) & ~repeated[:, None]


def decode_weights(model: StaticBloom) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The weights in the order ``csrc/decode_step.cpp`` reads them, and beside each its scales
    where it is quantized (an empty tensor elsewhere)."""
    none = torch.empty(0)
    norm = lambda ln: [(ln.weight, none), (ln.bias, none)]  # noqa: E731

    def weight(m):
        return (m.qweight, m.scales) if getattr(m, "quantized", False) else (m.weight, none)

    def linear(m):
        return [weight(m), (m.bias, none)]

    pairs = [weight(model.word_embeddings), *norm(model.word_embeddings_layernorm), *norm(model.ln_f)]
    for block in model.h:
        attention, mlp = block.self_attention, block.mlp
        pairs += [*norm(block.input_layernorm), *linear(attention.query_key_value), *linear(attention.dense),
                  *norm(block.post_attention_layernorm), *linear(mlp.dense_h_to_4h), *linear(mlp.dense_4h_to_h)]
    return [w.detach() for w, _ in pairs], [s for _, s in pairs]


def choose_kernels(path: str, cap: capability.Capability) -> tuple[Kernels | None, str]:
    """The kernel build for ``path`` and, where there is none, why."""
    if path in ("onednn", "plain"):
        return None, f"--cpu_path {path}"
    isa = cap.kernel_isa if path == "auto" else path
    if path != "auto" and not cap.can_run(path):
        raise CpuPathError(f"CPU path {path} cannot run on this CPU ({cap.why})")
    if isa is None:
        return None, f"no kernels for this CPU ({cap.why})"
    try:
        return load(isa), cap.why
    except KernelsUnavailable as error:
        if path != "auto":
            raise CpuPathError(f"the {path} CPU kernels {error}") from None
        return None, f"no kernels: {error}"


def use_amx_tiles(kernels: Kernels, wanted: bool) -> bool:
    """Turn the kernels' AMX products on (``wanted``) or off, for the process; whether they are on.
    On needs the process granted the tile state (``csrc/amx_rows.h``) and a probe product to agree
    with F.linear; otherwise they stay off."""
    if wanted and kernels.enable_amx(AMX_MIN_ROWS):
        if capability.agrees_with_linear(kernels.few_rows_linear, torch.bfloat16):  # its 20 rows run on the tiles
            return True
    kernels.enable_amx(0)
    return False


def quantized_kernel_rows(isa: str, dtype: torch.dtype, amx: bool, int4: bool, tiles: bool = False) -> int:
    """The most rows the quantized kernel serves (see ``quantize.py``): int8, many with bf16 inputs on
    the AVX-512 build and on the AVX2 build, up to 32 with fp32/fp16 inputs on the AVX-512 build; int4
    (which has no int8 op to fall back on), as many as it beats the dequantized weight through oneDNN.
    With the kernels' AMX tiles on (``tiles``, bf16), every row: from 8 rows they widen the weight a
    strip at a time on the tiles (``csrc/amx_rows.h``), where oneDNN needs it widened whole first."""
    if tiles and isa == "avx512_bf16" and dtype == torch.bfloat16:
        return INT4_KERNEL_ANY_ROWS
    if int4:
        if isa != "avx512_bf16":  # fp32 has an fp32 GEMM to dequantize into; bf16 and fp16 do not
            return INT4_KERNEL_FLOAT_ROWS if dtype == torch.float32 else INT4_KERNEL_ANY_ROWS
        return INT4_KERNEL_BF16_ROWS if dtype == torch.bfloat16 else INT4_KERNEL_FLOAT_ROWS
    if isa == "avx512_bf16" and dtype == torch.bfloat16:
        return FEW_ROWS_AMX if amx else INT8_KERNEL_MANY_ROWS
    return INT8_KERNEL_MANY_ROWS if isa == "avx2" else INT8_KERNEL_FLOAT_ROWS


# int4's kernel against the weight dequantized into scratch memory and multiplied by oneDNN: the
# kernel reads the packed weight once, oneDNN's products block many rows better, so on the AVX-512
# build oneDNN wins past 16 rows in bf16 and past 32 in fp32; on the AVX2 build past 32 in fp32,
# while bf16 and fp16 have no fast product there and the kernel keeps every size (where the widened
# fp32 products are routed, they take the rows routed to them: routes.py) (bench/cpu_products_bench.py).
INT4_KERNEL_BF16_ROWS = 16
INT4_KERNEL_FLOAT_ROWS = 32
INT4_KERNEL_ANY_ROWS = 1 << 30


# The server's mixed step as one call against op by op: past 16 rows the kernel's products lose to
# oneDNN's by less than the op-by-op step spends on dispatch and copies, up to these many tokens
# (fewer over int8 and int4 weights, whose many-row products op by op are oneDNN's on the
# dequantized weight, which gains on the kernel sooner). Where the kernel serves fewer rows than 16
# (AMX's oneDNN, int8 in fp32), the mixed step keeps the decode step's limit. The limits count the
# tokens the one call computes (``computed_tokens``); docs/performance.md gives the timings.
MIXED_ROWS = 80
MIXED_ROWS_QUANTIZED = 48


class DequantizeScratch:
    """int4 weights dequantized for a product of many rows go into one buffer, reused by every layer
    in turn: a fresh [N, K] tensor per product would spend more time faulting in its pages than
    dequantizing into them. Each product uses its weight before the next one is made."""

    def __init__(self, dequantize: Callable):
        self.dequantize = dequantize
        self.buffer = torch.empty(0)

    def __call__(self, q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows, cols = q.shape[0], 2 * q.shape[1]
        if self.buffer.numel() < rows * cols or self.buffer.dtype != dtype:
            self.buffer = torch.empty(rows * cols, dtype=dtype)
        out = self.buffer[: rows * cols].view(rows, cols)
        self.dequantize(q, scales, out)
        return out


def apply_routes(model: StaticBloom, linears: list, quantized: list, chosen: routes.RowRoutes,
                 wide: WidenedProducts, kernels: Kernels | None) -> str | None:
    """The chosen routes on every float linear, the head and the quantized products (one
    ``WidenedProducts`` scratch for all). The head's decode rows keep their product (the head is
    not among the products timed; widened, a decode step would widen the whole vocabulary), and so
    do int4's head's every rows (its kernel serves any). The user's ``--int8_activations on``
    stays. Returns the integer products' scope for the load line: '' (every product), ' for
    prompts', ' for decode rows', or None (none)."""
    block_kernel = kernels.block_q8_linear if kernels is not None else None
    for linear in linears:
        routes.set_routes(linear, chosen, wide, None)
    if isinstance(model.head, CpuTiedHead):
        routes.set_routes(model.head, replace(chosen, decode="native"), wide, None)
    shared = routes.RoutedWide(wide, chosen)
    for module in quantized:
        if module.int8_activations and not module.__dict__.get("auto_integer"):  # --int8_activations on
            module.block_kernel = block_kernel
        elif hasattr(module, "embeddings") and module.embeddings.qweight.dtype == torch.uint8 and module.kernel:
            unwidened = tuple("native" if p == "widened" else p for p in chosen.prompts)
            routes.set_routes(module, replace(chosen, prompts=unwidened), wide, block_kernel)
        else:
            routes.set_routes(module, chosen, shared, block_kernel)
    integer = [m for m in quantized if m.int8_activations]
    if not integer:
        return None
    prompts = all(m.integer_prompts for m in integer)
    decode = all(m.integer_decode for m in integer)
    return "" if prompts and decode else " for prompts" if prompts else " for decode rows"


def widened_note(chosen: routes.RowRoutes) -> str:
    """Where the products are widened, for the load line."""
    where = [f"{key.partition(':')[2]} rows" for key, pick in zip(routes.PROMPT_KEYS, chosen.prompts)
             if pick == "widened"]
    if chosen.decode == "widened":
        where.append("decode rows")
    return f"products in fp32, weights widened ({', '.join(where)})"


def integer_allowed(model: StaticBloom, quantized: list) -> bool:
    """Every quantized product's rows are whole blocks of 32 (``check_rows``)."""
    try:
        check_rows(quantized, model.parallel.world_size)
    except Int8ActivationsError:
        return False
    return bool(quantized)


def integer_modes(model: StaticBloom, options: CpuOptions, quantized: list, compile_steps: bool) -> tuple[bool, bool]:
    """Whether the quantized products must run as integer products (the user's choice, or
    ``--int8_activations on``), and whether they may (``auto``, where every product's rows allow)."""
    must = bool(quantized) and (options.int8_activations == "on" or
                                all(m.int8_activations and not m.__dict__.get("auto_integer") for m in quantized))
    may = options.int8_activations == "auto" and not compile_steps and integer_allowed(model, quantized)
    return must, may


def route_candidates(model: StaticBloom, options: CpuOptions, cap: capability.Capability,
                     kernels: Kernels | None, linears: list, quantized: list,
                     compile_steps: bool) -> tuple[dict[str, list[str]], dict[str, str]]:
    """The candidates of each key of the choice (``routes.PROMPT_KEYS``, 'decode') that this model
    and these options allow, and the static pick of each (the rule of thumb: widened prompts of
    more than 16 rows where bf16 products are emulated, weight-only quantized products). A bucket
    whose rows the few-rows kernel takes whatever the route offers 'native' and 'widened' alone."""
    dtype = model.word_embeddings.weight.dtype
    must_integer, may_integer = integer_modes(model, options, quantized, compile_steps)
    may_widen = options.widen and options.path != "plain" and not compile_steps and \
        dtype in (torch.bfloat16, torch.float16)
    block = model.h[0]
    first = [block.self_attention.query_key_value, block.self_attention.dense, block.mlp.dense_h_to_4h,
             block.mlp.dense_4h_to_h]
    widened = ["widened"] if may_widen else []
    prompts, decode = [], []
    if must_integer:
        prompts, decode = ["integer"], ["integer"]
    elif quantized:
        prompts = ["native"] + widened + (["integer"] if may_integer else [])
        decode = ["weight-only"] + (["integer"] if may_integer else [])
    elif all(m in linears for m in first):
        # fp32: torch's F.linear is MKL's; oneDNN's own fp32 product beat it and our kernel on an
        # AVX2 CPU's prompts (docs/performance.md), lost to the kernel with AVX-512.
        onednn = options.path != "plain" and not compile_steps and dtype == torch.float32 and \
            capability.onednn_plain_linear(dtype)
        prompts = ["native"] + widened + \
            (["kernel"] if kernels is not None and all(m.kernel is not None for m in first) else []) + \
            (["onednn"] if onednn else [])
        decode = ["native"] + widened
    keys = {key: list(prompts) for key in routes.PROMPT_KEYS}
    if "kernel" in prompts or "onednn" in prompts:  # float weights: first are CpuProducts
        for key, (most, _) in zip(routes.PROMPT_KEYS, routes.PROMPT_BUCKETS):
            if most is not None and all(m.kernel_serves(most) for m in first):
                # 'kernel' and 'onednn' would run the few-rows kernel's product here, as 'native' does.
                keys[key] = [name for name in prompts if name not in ("kernel", "onednn")]
    keys["decode"] = decode
    rule = "integer" if decode == ["integer"] else "widened" if widened and cap.emulates_bf16 else "native"
    static = {key: rule for key in routes.PROMPT_KEYS}
    static[routes.PROMPT_KEYS[0]] = rule if rule == "integer" else "native"  # a few rows: the kernel's, as ever
    static["decode"] = "integer" if decode == ["integer"] else "weight-only" if quantized else "native"
    if not prompts and may_widen and cap.emulates_bf16:  # products of another kind (LoRA rows): the rule, untimed
        keys = {key: [static[key]] for key in routes.PROMPT_KEYS}
    return keys, static


def choose_routes(model: StaticBloom, options: CpuOptions, cap: capability.Capability, kernels: Kernels | None,
                  linears: list, quantized: list, wide: WidenedProducts, compile_steps: bool,
                  amx_tiles: bool) -> choice.Chosen:
    """The route of each prompt bucket and of decode rows (``routes.py``): the candidates this
    model and these options allow, timed on a sample of the first block's products unless the
    choice is cached, static or forced (``choice.py``); rank 0's choice on every rank."""
    dtype = model.word_embeddings.weight.dtype
    keys, static = route_candidates(model, options, cap, kernels, linears, quantized, compile_steps)
    block = model.h[0]
    first = [block.self_attention.query_key_value, block.self_attention.dense, block.mlp.dense_h_to_4h,
             block.mlp.dense_4h_to_h]
    block_kernel = kernels.block_q8_linear if kernels is not None else None
    proxies = [routes.sampled(m) for m in first] if any(len(names) > 1 for names in keys.values()) else []
    candidates = routes.candidates(proxies, dtype, keys, wide, block_kernel)
    determined_by = {"dtype": str(dtype), "sample": routes.describe_sample(proxies),
                     "kernels": kernels.isa if kernels is not None else None, "amx_tiles": amx_tiles,
                     "options": [options.path, options.widen, options.amx, options.pack_weights,
                                 options.int8_activations]}
    try:
        return choice.agree(model.parallel, lambda: choice.choose(candidates, static, determined_by, options.choice,
                                                                  routes.TOGETHER))
    except choice.ChoiceError as error:
        raise CpuPathError(str(error)) from None


def accelerate(model: StaticBloom, options: CpuOptions = CpuOptions(), compile_steps: bool = False) -> CpuPlan:
    """Apply the CPU fast path to ``model`` (on the CPU, its weights loaded); see the module doc.
    With ``compile_steps`` torch.compile builds the decode step (and packs the weights) itself."""
    dtype = model.word_embeddings.weight.dtype
    cap = capability.detect()
    kernels, why = choose_kernels(options.path, cap)
    for module in model.modules():  # a choice of an earlier call is undone: it is made again below
        routes.clear_choice(module)
    # Quantized layers (bloom_hpu/quantize.py) keep their own int8 product.
    linears = [m for m in model.modules() if isinstance(m, tuple(CPU_LINEAR)) and not getattr(m, "quantized", False)]
    for linear in linears:
        swap(linear, CPU_LINEAR[getattr(linear, "plain_class", type(linear))])
    quantized = quantized_products(model)
    if options.int8_activations == "on" and quantized and not all(m.int8_activations for m in quantized):
        use_int8_activations(model)  # the option given to the runtime alone: as from_pretrained sets it
    used = []
    if options.huge_pages:  # first: the steps built below hold the weights where they are then
        move_weights(model)
        granted = huge_bytes(model_tensors(model))  # what the kernel gave, not what was asked
        if granted:
            used.append(f"weights in huge pages ({granted / 2**20:.0f} MB)")
    weight_format = quantized_mode(model)  # 'int8', 'int4' or None
    prefetch_kind = None
    if kernels is not None:
        prefetch_kind, prefetch_line = choose_prefetch(kernels, options.choice, model.parallel, dtype,
                                                       weight_format, options.huge_pages)
        used.append(prefetch_line)
    amx_tiles = kernels is not None and dtype == torch.bfloat16 and cap.amx and use_amx_tiles(kernels, options.amx)
    # Where integer products may run, how many rows they take in place (after the prefetch: timed
    # with it); not for int8 on AMX-INT8 tiles, which take every count past one pass.
    int8_on_tiles = amx_tiles and "amx_int8" in (capability.cpu_flags() or set()) and weight_format == "int8"
    if kernels is not None and weight_format and any(integer_modes(model, options, quantized, compile_steps)) and \
            not int8_on_tiles:
        in_place = choose_integer_rows(kernels, options.choice, model.parallel, weight_format, dtype,
                                       options.huge_pages, prefetch_kind)
        used += [in_place] if in_place else []
    # The kernel's row limit: higher where its bf16 products run on AMX tiles; lower where AMX
    # gives oneDNN's bf16 products of many rows the edge over the kernel's AVX-512 loop.
    untiled_rows = FEW_ROWS_AMX if cap.amx and dtype == torch.bfloat16 else FEW_ROWS
    few_rows = AMX_TILE_ROWS if amx_tiles else untiled_rows
    if kernels is not None:
        for linear in linears:
            if kernel_suits(linear.weight):
                linear.kernel, linear.few_rows_limit = kernels.few_rows_linear, few_rows * linear.weight.shape[1]
        if kernel_suits(model.word_embeddings.weight) and not getattr(model.head, "quantized", False):
            swap(model.head, CpuTiedHead, kernel=kernels.few_rows_linear,
                 few_rows_limit=few_rows * model.word_embeddings.weight.shape[1])
        tiles = f", from {AMX_MIN_ROWS} on AMX tiles" if amx_tiles else ""
        used.append(f"few-rows products (up to {few_rows} rows{tiles})")
        scratch = DequantizeScratch(kernels.int4_dequantize)
        for module in quantized:
            q = module.embeddings.qweight if hasattr(module, "embeddings") else module.qweight
            if q.dtype == torch.uint8 and hasattr(module, "embeddings"):
                # The head, whatever the rows (a scoring pass): dequantized, it would hold a scratch
                # copy of the vocabulary's weights (bloom's: 7 GB in bf16) for the rest of the run.
                module.kernel, module.kernel_rows = kernels.int4_rows_linear, INT4_KERNEL_ANY_ROWS
            elif q.dtype == torch.uint8:  # int4: every row is whole groups of 32
                module.kernel = kernels.int4_rows_linear
                module.kernel_rows = quantized_kernel_rows(kernels.isa, dtype, cap.amx, int4=True, tiles=amx_tiles)
                module.int4_dequantize = None if compile_steps else scratch
            elif q.shape[1] % 16 == 0:
                module.kernel = kernels.int8_rows_linear
                many = quantized_kernel_rows(kernels.isa, dtype, cap.amx, int4=False, tiles=amx_tiles)
                module.kernel_rows = many if q.shape[1] % 32 == 0 else INT8_KERNEL_ROWS
    # The GELU inside the product before the routes are timed: they are timed as they will run.
    onednn = options.path != "plain" and not compile_steps and dtype == torch.bfloat16
    fused_gelu = onednn and capability.onednn_fuses_gelu(dtype) and all(b.mlp.dense_h_to_4h in linears for b in model.h)
    if fused_gelu:
        for block in model.h:
            block.mlp.dense_h_to_4h.fused_gelu = True
            block.mlp.gelu = torch.nn.Identity()
    wide = WidenedProducts(kernels.int4_dequantize if kernels is not None else None)
    chosen = choose_routes(model, options, cap, kernels, linears, quantized, wide, compile_steps, amx_tiles)
    row_routes = routes.RowRoutes.of(chosen.picks, decode="weight-only" if quantized else "native")
    integer_scope = apply_routes(model, linears, quantized, row_routes, wide, kernels)
    if quantized:
        public = "" if kernels is not None else " in public ops"
        mode_name = f"{weight_format} " if kernels is not None else ""
        if integer_scope is not None:
            used.append(f"{mode_name}integer products{integer_scope}{public} (activations int8 per block of 32)")
        if kernels is not None and integer_scope != "":
            used.append(f"{weight_format} few-rows products")
    integer = [m for m in quantized if m.int8_activations]
    integer_decode = bool(integer) and all(m.integer_decode for m in integer)
    widened = row_routes.uses("widened")
    if widened:
        used.append(widened_note(row_routes))
    if "kernel" in row_routes.prompts:
        used.append("the few-rows kernel for prompts too")
    if fused_gelu:
        used.append("oneDNN GELU in the prefill's MLP")
    # The MLPs whose product does not fuse their GELU: quantized ones, and in bf16/fp16 float ones
    # too (the kernel's GELU runs at 3.4x ATen's). An fp32 model keeps ATen's, the reference's own
    # op, whose last bit its log-probs are held to (one rounding apart moved them by 1e-5).
    plain_gelus = [b.mlp for b in model.h
                   if isinstance(b.mlp.gelu, torch.nn.GELU) and b.mlp.gelu.approximate == "tanh"
                   and (b.mlp.dense_h_to_4h in quantized or dtype != torch.float32)]
    if kernels is not None and not compile_steps and plain_gelus:
        for mlp in plain_gelus:
            mlp.gelu = KernelGelu(kernels.gelu_tanh)
        used.append("threaded GELU")
    if kernels is None and onednn and not widened and options.pack_weights and capability.onednn_packs(dtype):
        for linear in linears:
            linear.pack()
        used.append("oneDNN packed weights")
    plan = CpuPlan("", kernels, decode_rows=few_rows)
    if kernels is not None and options.one_call_steps:
        if quantized:  # every weight quantized, each served by its kernel: the quantized one-call step
            all_kernel = all((m.block_kernel if m.int8_activations and m.integer_decode else m.kernel) is not None
                             for m in quantized)
        else:  # and the decode rows not widened: the one call multiplies through the kernel
            all_kernel = isinstance(model.head, CpuTiedHead) and all(m.kernel is not None for m in linears) and \
                row_routes.decode == "native"
        if not compile_steps and model.parallel.world_size == 1 and all_kernel:
            plan.decode = OneCallDecode(model, kernels.decode_step,
                                        kernels.decode_step_quantized if quantized else None, integer_decode)
            if integer_decode:  # integer products of any rows, through one kernel
                plan.decode_rows = FEW_ROWS
            elif quantized:  # as many rows as the quantized kernel serves, at most the bf16 step's untiled ones
                plan.decode_rows = min([untiled_rows] + [m.kernel_rows for m in quantized])
            if plan.decode_rows < FEW_ROWS:
                plan.mixed_rows = plan.decode_rows
            elif amx_tiles and not quantized:  # the products of many tokens on AMX tiles
                plan.mixed_rows = AMX_TILE_ROWS
            else:
                plan.mixed_rows = MIXED_ROWS_QUANTIZED if quantized else MIXED_ROWS
            kind = f" ({weight_format}{', integer' if integer_decode else ''})" if quantized else ""
            used.append(f"one-call decode step{kind}")
        for block in model.h:
            swap(block.self_attention, OneCallPromptAttention, op=kernels.prompt_attention,
                 extend_op=kernels.extend_attention)
            plan.prompt_attention.append(block.self_attention)
        used.append("one-call prompt attention")
    source = "PyTorch operations" if kernels is None else f"{capability.ISA_NAMES[kernels.isa]} kernels"
    route_note = f"; routes {chosen.describe()}" if chosen.picks else ""  # last: what this CPU's timing chose
    plan.description = f"{source}{': ' + ', '.join(used) if used else ''} ({why}){route_note}"
    return plan
