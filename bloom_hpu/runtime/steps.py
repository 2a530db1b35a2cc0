"""The model's steps as small modules bound to one KV cache, and the runner that owns them.

A step module's only inputs are the tensors that change per call (token ids, lengths, positions);
the weights and the cache are fixed attributes. That is what graph capture needs: the same step
object always touches the same memory. ``StepRunner`` keeps one cache per (batch, length) shape and
one step module per (kind, cache, window), so repeated calls reuse both and never re-capture.

Steps: ``prefill`` (prompts -> logits of each row's last token), ``decode`` (one token per row),
``mixed`` (a decode with segments of joining prompts in it: the server), ``verify`` and
``verify_mixed`` (speculation's verify pass, alone or with those segments), ``extend`` (prompts
continued after a prefix copied from the prefix cache),
and for scoring prompts (log-probs, evaluation) ``hidden`` (final hidden states at every position)
and ``head`` (logits of a slice of them). Every one goes through the backend, which records its
shape signature and, on a Gaudi, captures it and ends it with ``mark_step``.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..int8_activations import as_decode_rows
from ..kv_cache import KVCache
from ..model import StaticBloom
from ..prefix_cache import DEFAULT_BLOCK, PrefixCache
from .backends import Backend


def real_span(input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, P] right-padded ids cut to the longest real row [B, max(lengths)].

    The static P is what a captured graph needs; an eager prefill gains nothing from the pad slots
    past the longest prompt: their keys and values are never attended (a row's decode writes each
    slot before it attends it), and the logits come from real tokens. A 16-token prompt padded to
    128 then costs a 16-token prefill. The step's signature stays [B, P]."""
    return input_ids[:, : int(lengths.max())]


def step_input(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor of its own: contiguous, at offset 0 of its storage, not a view.

    What the search loops and warm-up pass to every step. HPU graphs are cached on each input's
    shape, dtype, strides, storage offset and view-ness, so ``slots[step]`` (a view at a new offset
    each step) would capture a new graph every token, and a view in the real run against a plain
    tensor in warm-up would make warm-up capture graphs the run never replays. A copy of a few
    hundred bytes per step costs microseconds."""
    return t.clone(memory_format=torch.contiguous_format)


class PrefillStep(nn.Module):
    runs_prompts = True  # the first token (HPU: no graph for it under tensor parallelism)

    def __init__(self, model: StaticBloom, cache: KVCache, backend: Backend, hidden_only: bool = False):
        super().__init__()
        self.model = model
        self.cache = cache
        self.backend = backend  # its ``trim_prefill``: stop at the longest real prompt (``real_span``)
        self.hidden_only = hidden_only  # scoring: hidden states at every position, not logits

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length)

    def forward(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.backend.trim_prefill:
            input_ids = real_span(input_ids, lengths)
        if self.hidden_only:
            return self.model.hidden_states(input_ids, lengths, self.cache)
        return self.model.prefill(input_ids, lengths, self.cache)


class DecodeStep(nn.Module):
    def __init__(self, model: StaticBloom, cache: KVCache, window: int):
        super().__init__()
        self.model = model
        self.cache = cache
        self.window = window

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length, self.window)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.decode(tokens, positions, self.cache, self.window)


class MixedStep(DecodeStep):
    """A decode step that carries prompt segments (``StaticBloom.mixed``): the server's prefill in
    pieces. Its shape is (rows, cache length, window, segments, segment length). On the CPU, the
    backend runs it as the one-call decode step with the segments' tokens added (``OneCallDecode.mixed``)."""

    def forward(self, tokens, positions, chunk, chunk_row, chunk_start, chunk_len) -> torch.Tensor:
        return self.model.mixed(tokens, positions, chunk, chunk_row, chunk_start, chunk_len, self.cache, self.window)


class VerifyStep(DecodeStep):
    """Speculation's verify pass: row b's last token and its guesses, ids [B, S], written from slots
    ``starts`` [B] (clamped to the cache), each attending the row's slots up to its own
    (``StaticBloom.extend_hidden``); logits of every position, [B, S, V]. Its shape is (rows, cache
    length, window, S), captured like the decode step. A rejected guess's keys and values stay in
    their slot until the row writes it again; nothing attends them before."""

    def forward(self, ids: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        with as_decode_rows():  # quantized products take the route of the decode steps this pass stands for
            return self.model.lm_head(self.model.extend_hidden(ids, starts, self.cache, self.window))


class VerifyMixedStep(DecodeStep):
    """A verify pass that carries prompt segments (``StaticBloom.verify_mixed``): the server
    speculating while prompts join. Its shape is (rows, cache length, window, S, segments, segment
    length); logits [B*S + G, V]."""

    def forward(self, ids, starts, chunk, chunk_row, chunk_start, chunk_len) -> torch.Tensor:
        with as_decode_rows():  # as VerifyStep
            return self.model.verify_mixed(ids, starts, chunk, chunk_row, chunk_start, chunk_len, self.cache,
                                           self.window)


class ExtendStep(nn.Module):
    """Prompts continued after slots a prefix cache copied in (``StaticBloom.extend``): its shape
    is (rows, cache length, rest length R); the window is the whole cache."""

    runs_prompts = True  # a first token, as the prefill's

    def __init__(self, model: StaticBloom, cache: KVCache, backend: Backend, hidden_only: bool = False):
        super().__init__()
        self.model = model
        self.cache = cache
        self.backend = backend
        self.hidden_only = hidden_only  # scoring: hidden states at every position, not logits

    @property
    def static_shape(self) -> tuple:
        return (self.cache.batch_size, self.cache.length)

    def forward(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        if self.backend.trim_prefill:  # eager: no compute for pad columns past the longest rest
            input_ids = real_span(input_ids, lengths)
        if self.hidden_only:
            return self.model.extend_hidden(input_ids, starts, self.cache, self.cache.length)
        return self.model.extend(input_ids, starts, lengths, self.cache, self.cache.length)


class HeadStep(nn.Module):
    """Logits [R, S, V] of final hidden states [R, S, hidden] (a slice of a scoring pass)."""

    def __init__(self, model: StaticBloom):
        super().__init__()
        self.model = model

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden)


class StepRunner:
    """Runs the steps of one model on one backend, and owns its prefix cache (when it has one):
    made by ``enable_prefix_cache``, set aside by ``prefix_paused``, its namespace set by
    ``prefix_namespace_of``; the prefills that use it read it as ``prefix``."""

    def __init__(self, model: StaticBloom, backend: Backend):
        self.model = model
        self.backend = backend
        backend.prepare_model(model)
        self._caches: dict[tuple[int, int], KVCache] = {}
        self._steps: dict[tuple, nn.Module] = {}
        self._prefix: PrefixCache | None = None  # bloom_hpu/prefix_cache.py, when one is enabled
        self._prefix_paused = False
        # Whose keys and values the steps compute now: a served LoRA adapter's are its own (set by
        # the server while every row runs one adapter); the prefix cache keeps them apart.
        self._prefix_namespace = ""

    # --- the prefix cache -----------------------------------------------------------------------

    @property
    def prefix(self) -> PrefixCache | None:
        """The prefix cache the prefills use now: None when there is none, or while it is paused."""
        return None if self._prefix_paused else self._prefix

    @property
    def prefix_namespace(self) -> str:
        """The namespace of the keys and values the steps compute now (``prefix_namespace_of``)."""
        return self._prefix_namespace

    def enable_prefix_cache(self, capacity: int, block: int = DEFAULT_BLOCK) -> PrefixCache | None:
        """A prefix cache of ``capacity`` blocks of ``block`` tokens for this model, in the layout
        and copy shapes of this backend, replacing any earlier one; 0: none. (The size the user
        gives, and whether it fits, are the generator's: ``generation/run/prefix_pool.py``.)"""
        self._prefix = None  # an earlier pool is freed before the new one is allocated
        if capacity > 0:
            self._prefix = PrefixCache.for_model(self.model, capacity, self.backend.per_layer_cache,
                                                 fixed_copy_shapes=self.backend.compiles_eager_ops, block=block)
        return self._prefix

    @contextlib.contextmanager
    def prefix_paused(self):
        """Within it the prefills neither use nor fill the prefix cache (``prefix`` is None): a
        warm-up's filler prompts run as prefills and leave nothing behind."""
        paused, self._prefix_paused = self._prefix_paused, True
        try:
            yield
        finally:
            self._prefix_paused = paused

    @contextlib.contextmanager
    def prefix_namespace_of(self, namespace: str):
        """Within it the steps compute keys and values of ``namespace`` (a served LoRA adapter's):
        what the prefix cache stores and finds is that namespace's."""
        outer, self._prefix_namespace = self._prefix_namespace, namespace
        try:
            yield
        finally:
            self._prefix_namespace = outer

    def cache(self, batch_size: int, length: int) -> KVCache:
        """The cache for this shape, allocated on first use and then reused."""
        key = (batch_size, length)
        if key not in self._caches:
            self._caches[key] = self.model.allocate_cache(batch_size, length, self.backend.per_layer_cache)
        return self._caches[key]

    def release_caches(self) -> None:
        self._caches.clear()
        self._steps.clear()

    def _step(self, kind: str, cache: KVCache | None = None, window: int | None = None) -> nn.Module:
        key = (kind, id(cache), window)
        if key not in self._steps:
            step = {
                "prefill": lambda: PrefillStep(self.model, cache, self.backend),
                "hidden": lambda: PrefillStep(self.model, cache, self.backend, hidden_only=True),
                "decode": lambda: DecodeStep(self.model, cache, window),
                "mixed": lambda: MixedStep(self.model, cache, window),
                "verify": lambda: VerifyStep(self.model, cache, window),
                "verify_mixed": lambda: VerifyMixedStep(self.model, cache, window),
                "extend": lambda: ExtendStep(self.model, cache, self.backend),
                "extend_hidden": lambda: ExtendStep(self.model, cache, self.backend, hidden_only=True),
                "head": lambda: HeadStep(self.model),
            }[kind]()
            self._steps[key] = self.backend.prepare(step)
        return self._steps[key]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        return self.backend.run("prefill", self._step("prefill", cache), input_ids, lengths)

    @torch.no_grad()
    def prefill_shared(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache, copies: int,
                       prompt_ids: list[list[int]] | None = None, namespace: str | None = None,
                       requests: int | None = None) -> torch.Tensor:
        """Prefill B prompts [B, P] once each for a cache of B * ``copies`` rows, prompt-major
        (beams, sampled copies): the prompts run in a B-row cache of length P, whose slots every
        copy then takes. Logits [B * copies, V]. transformers runs all B * copies rows instead.

        ``prompt_ids``: the prompts' token ids on the host; with them, and a prefix cache, what
        the cache holds of each prompt is copied rather than computed (``prefixed.py``); ``requests``:
        how many leading prompts are requests (the rest fill the batch's shape: not looked up or stored)."""
        if self.prefix is not None and prompt_ids is not None:
            from .prefixed import prefill_with_prefixes
            namespace = self.prefix_namespace if namespace is None else namespace
            prefill = lambda ids, n, c: prefill_with_prefixes(self, ids, n, c, prompt_ids, namespace, requests)  # noqa: E731
        else:
            prefill = self.prefill
        if copies == 1:
            return prefill(input_ids, lengths, cache)
        prompts = self.cache(input_ids.shape[0], input_ids.shape[1])
        logits = prefill(input_ids, lengths, prompts)
        cache.copy_prompts(prompts, copies)
        return logits.repeat_interleave(copies, dim=0)

    @torch.no_grad()
    def extend(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Rests of prompts [B, R] after ``starts`` [B] slots already in ``cache``: logits [B, V]."""
        return self.backend.run("extend", self._step("extend", cache), input_ids, starts, lengths)

    @torch.no_grad()
    def extend_hidden(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
                      cache: KVCache) -> torch.Tensor:
        """Final hidden states [B, span, hidden] of rests [B, R] after ``starts`` [B] slots already in
        ``cache`` (scoring); span is R, or the longest rest where the backend trims prefills."""
        return self.backend.run("extend_hidden", self._step("extend_hidden", cache), input_ids, starts, lengths)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        return self.backend.run("decode", self._step("decode", cache, window), tokens, positions)

    @torch.no_grad()
    def verify(self, ids: torch.Tensor, starts: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """Logits [B, S, V] of ids [B, S] written from slots ``starts`` [B], attending slots < ``window``."""
        return self.backend.run("verify", self._step("verify", cache, window), ids, starts)

    @torch.no_grad()
    def verify_mixed(self, ids: torch.Tensor, starts: torch.Tensor, chunk: torch.Tensor, chunk_row: torch.Tensor,
                     chunk_start: torch.Tensor, chunk_len: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """A verify of ids [B, S] from ``starts`` [B] with G prompt segments [G, C] in it: logits [B*S + G, V]."""
        return self.backend.run("verify_mixed", self._step("verify_mixed", cache, window), ids, starts, chunk,
                                chunk_row, chunk_start, chunk_len)

    @torch.no_grad()
    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, chunk: torch.Tensor, chunk_row: torch.Tensor,
              chunk_start: torch.Tensor, chunk_len: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """A decode of [B, 1] tokens with S prompt segments [S, C] in it: logits [B + S, V]."""
        return self.backend.run("mixed", self._step("mixed", cache, window), tokens, positions, chunk, chunk_row,
                                chunk_start, chunk_len)

    @torch.no_grad()
    def hidden_states(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Final hidden states [B, span, hidden] of right-padded prompts [B, P] (scoring); span is
        P, or the longest real row where the backend trims prefills."""
        return self.backend.run("hidden", self._step("hidden", cache), input_ids, lengths)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [R, S, V] of hidden states [R, S, hidden] (a scoring pass, a slice at a time)."""
        return self.backend.run("head", self._step("head"), hidden)
