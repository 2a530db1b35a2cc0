"""BLOOM rewritten for static shapes.

Two entry points, both with shapes fixed in advance:

* ``prefill(input_ids [B, P], lengths [B], cache)``: prompts right-padded to P; writes the KV cache
  slots 0..P-1 (on CPU and CUDA only those up to the longest prompt, ``trim_prefill``) and returns the
  logits of each row's last real token only ([B, V]; the full [B, P, V] logits are never built).
* ``decode(tokens [B, 1], positions [B], cache, window)``: one new token per row, written into the
  cache at the row's own slot; attends over the first ``window`` slots ([B, V] logits).

Module and parameter names follow the transformers checkpoints (``h.0.self_attention.dense``...), so
weights load by name. Tensor parallelism enters through ``parallel`` (see ``parallel.py``): each rank
holds ``n_head / world`` heads and slices of the MLP and the vocabulary, and the row-parallel
linears finish with an all-reduce. With one process those calls are no-ops.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .alibi import alibi_slopes
from .config import BloomConfig
from .runtime.cpu import kernels as cpu_kernel
from .kv_cache import KVCache
from .parallel import Parallel, SINGLE


class Linear(nn.Linear):
    """``nn.Linear`` with CPU speed-ups, each switched on by the backend (``prepare_model``):

    * ``few_rows``: our own kernel (``cpu_kernel.py``) for inputs of at most ``FEW_ROWS`` rows
      (decode: a few rows times a weight too large for the caches, bound by reading the weight),
      on the plain weight; larger inputs (a prefill) still go to ``F.linear``.
    * ``pack()``, where that kernel cannot be had: the weight handed once to oneDNN in the blocked
      layout its kernels read fastest (bit-identical results; 17-19 GB/s against 12.7 GB/s plain
      on a Xeon with AVX512-BF16). The plain weight is dropped (a meta tensor keeps its shape and
      dtype), so memory holds one copy of the weights, not two.
    * ``fuse_gelu``: ``forward_gelu`` lets oneDNN apply an MLP's GELU inside the product.
    """

    packed: torch.Tensor | None = None
    few_rows: Callable | None = None  # the kernel, set only where the weight suits it
    few_rows_limit = 0  # inputs of at most this many elements go to it
    fuse_gelu = False

    def use_few_rows(self, kernel: Callable) -> bool:
        if self.packed is not None or not cpu_kernel.suits(self.weight):
            return False
        self.few_rows, self.few_rows_limit = kernel, cpu_kernel.row_limit(self.weight)
        return True

    def takes_few_rows(self, x: torch.Tensor) -> bool:
        return self.few_rows is not None and x.numel() <= self.few_rows_limit

    def pack(self) -> None:
        if self.packed is None:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.takes_few_rows(x):
            return self.few_rows(x, self.weight, bias)
        if self.packed is None:
            return F.linear(x, self.weight, bias)
        # oneDNN reads the input as dense: make sure it is.
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu_tanh(self(x))``. With ``fuse_gelu``, for inputs the few-rows kernel does not take
        (a prefill), oneDNN applies the GELU to the fp32 sums before rounding once: one pass over
        [rows, 4 * hidden] less (a bloom-560m 128-token prefill: ~1 ms a layer, 24 ms in all)."""
        if self.fuse_gelu and not self.takes_few_rows(x):
            weight = self.packed if self.packed is not None else self.weight
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, self.bias, "gelu", [], "tanh")
        return F.gelu(self(x), approximate="tanh")


class RowParallelLinear(Linear):
    """A linear whose input features are split across ranks: partial sums are all-reduced, and the
    bias (kept whole on every rank) is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, parallel: Parallel):
        super().__init__(in_features, out_features)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.product(x, self.bias)
        return self.parallel.all_reduce(self.product(x, None)) + self.bias


class Attention(nn.Module):
    def __init__(self, config: BloomConfig, parallel: Parallel):
        super().__init__()
        self.n_head = config.n_head // parallel.world_size  # heads on this rank
        self.head_dim = config.head_dim
        local_width = self.n_head * self.head_dim
        self.query_key_value = Linear(config.hidden_size, 3 * local_width)
        self.dense = RowParallelLinear(local_width, config.hidden_size, parallel)
        self.inv_norm = 1.0 / self.head_dim**0.5

    def _split_heads(self, x: torch.Tensor):
        """[B, T, H*3*D] -> q, k, v each [B, H, T, D]. BLOOM fuses per head: [q_h, k_h, v_h]."""
        b, t, _ = x.shape
        qkv = x.view(b, t, self.n_head, 3, self.head_dim)
        q, k, v = qkv.unbind(dim=3)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, k, v, alibi, hidden_mask=None):
        """Scaled scores + ALiBi, masked, fp32 softmax (as transformers), weighted values.

        q [B, H, T, D]; k, v [B, H, S, D]; alibi [B*H, 1, S]; hidden_mask bool, broadcastable to
        [B, 1, T, S], True where a key must not be seen (None: already folded into ``alibi``).
        """
        b, h, t, d = q.shape
        s = k.shape[2]
        scores = torch.baddbmm(
            alibi, q.reshape(b * h, t, d), k.reshape(b * h, s, d).transpose(1, 2), beta=1.0, alpha=self.inv_norm
        ).view(b, h, t, s)
        if hidden_mask is not None:
            scores = scores.masked_fill(hidden_mask, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        context = torch.matmul(probs, v)  # [B, H, T, D]
        return context.transpose(1, 2).reshape(b, t, h * d)

    def prefill(self, x, layer: int, cache: KVCache, hidden_mask, keep=None, lengths=None, kernel=None):
        """Keys and values of every position go to the cache; ``keep`` (see ``Block.forward``)
        limits the queries, and so the output, to the positions kept."""
        return self.dense(self.attend_prompt(self.query_key_value(x), layer, cache, hidden_mask, keep, lengths, kernel))

    def attend_prompt(self, qkv, layer: int, cache: KVCache, hidden_mask, keep=None, lengths=None, kernel=None):
        """The attention between a prefill's two products: qkv [B, P, H*3*D] -> context [B, kept, H*D].

        ``kernel`` (CPU, ``csrc/prompt_attention.cpp``): the same attention in one call, masked
        from ``lengths`` [B]; the only ``keep`` a prefill uses, each row's last real token, is
        its ``last_only``."""
        if kernel is not None:
            return kernel(qkv, lengths, cache.keys[layer], cache.values[layer], cache.alibi, keep is not None)
        q, k, v = self._split_heads(qkv)
        cache.write_prefix(layer, k, v)
        p = qkv.shape[1]
        if keep is not None:  # [B, H, P, ...] -> [B, H, kept, ...], picked along the positions
            q = keep(q.transpose(1, 2)).transpose(1, 2)
            hidden_mask = keep(hidden_mask.transpose(1, 2)).transpose(1, 2)
        return self._attend(q, k, v, cache.alibi[:, :, :p], hidden_mask)

    def decode(self, x, layer: int, cache: KVCache, positions, window: int, masked_alibi):
        """``masked_alibi`` [B*H, 1, W]: the ALiBi bias with unseen slots at the dtype's minimum."""
        q, k, v = self._split_heads(self.query_key_value(x))
        cache.write_at(layer, positions, k, v)
        keys = cache.keys[layer, :, :, :window]
        values = cache.values[layer, :, :, :window]
        return self.dense(self._attend(q, keys, values, masked_alibi))


class MLP(nn.Module):
    def __init__(self, config: BloomConfig, parallel: Parallel):
        super().__init__()
        local_ffn = 4 * config.hidden_size // parallel.world_size
        self.dense_h_to_4h = Linear(config.hidden_size, local_ffn)
        self.dense_4h_to_h = RowParallelLinear(local_ffn, config.hidden_size, parallel)

    def forward(self, x):
        return self.dense_4h_to_h(self.dense_h_to_4h.forward_gelu(x))


class Block(nn.Module):
    def __init__(self, config: BloomConfig, parallel: Parallel):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = Attention(config, parallel)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config, parallel)
        self.residual_from_ln = config.apply_residual_connection_post_layernorm

    def forward(self, h, attend, keep=None):
        """``attend(x)`` runs this block's attention in prefill or decode form. ``keep(t)`` picks
        the positions ([B, P, ...] -> [B, kept, ...]) whose output is wanted; attention sees every
        position, the rest of the block runs on the kept ones only."""
        x = self.input_layernorm(h)
        residual = x if self.residual_from_ln else h
        h = (residual if keep is None else keep(residual)) + attend(x)
        x = self.post_attention_layernorm(h)
        return (x if self.residual_from_ln else h) + self.mlp(x)


class VocabParallelEmbedding(nn.Embedding):
    """Word embeddings split by vocabulary rows across ranks (the LM head reuses them, tied)."""

    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel):
        self.vocab_start, self.vocab_end = parallel.vocab_range(vocab_size)
        super().__init__(self.vocab_end - self.vocab_start, hidden_size)
        self.parallel = parallel

    def forward(self, ids):
        if self.parallel.world_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return self.parallel.all_reduce(out)


def prompt_mask(lengths: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, 1, P, P] bool, True where query q of a right-padded prompt must not see key k."""
    slots = torch.arange(prompt_len, device=lengths.device)
    # A query at q sees keys k <= q that are real tokens of its row. Pad queries (q >= length)
    # still see every real key, so no row of the softmax is empty.
    causal = slots[None, :] > slots[:, None]  # [P(q), P(k)]
    padding = slots[None, :] >= lengths[:, None]  # [B, P(k)]
    return causal[None, None] | padding[:, None, None, :]


class StaticBloom(nn.Module):
    few_rows: Callable | None = None  # the LM head's kernel for few rows (``use_few_rows_kernel``)
    cpu_decode: Callable | None = None  # the whole decode step in one call (``use_cpu_decode_step``)
    prompt_attention: Callable | None = None  # a prefill's attention in one call (CPU, ``csrc/prompt_attention.cpp``)
    trim_prefill = False  # a prefill stops at the longest real prompt (CPU, CUDA; see ``prefill``)

    def __init__(self, config: BloomConfig, parallel: Parallel = SINGLE):
        super().__init__()
        if config.n_head % parallel.world_size:
            raise ValueError(f"{config.n_head} heads cannot be split evenly over {parallel.world_size} ranks")
        self.config = config
        self.parallel = parallel
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.h = nn.ModuleList(Block(config, parallel) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        local_heads = config.n_head // parallel.world_size
        first = parallel.rank * local_heads
        # This rank's heads' slopes; a buffer so .to(device) moves it, not saved in checkpoints.
        self.register_buffer(
            "slopes", alibi_slopes(config.n_head)[first : first + local_heads], persistent=False
        )

    @property
    def local_heads(self) -> int:
        return self.config.n_head // self.parallel.world_size

    def allocate_cache(self, batch_size: int, length: int) -> KVCache:
        p = next(self.parameters())
        return KVCache.allocate(
            self.config.n_layer, batch_size, self.local_heads, length, self.config.head_dim,
            self.slopes, p.dtype, p.device,
        )

    def pack_linears(self) -> int:
        """Pack the blocks' linear weights for oneDNN (see ``Linear``); returns how many. The tied
        LM head stays plain: the embedding lookup needs the plain rows, and a packed copy beside
        them would add half the model's size."""
        linears = [m for m in self.h.modules() if isinstance(m, Linear)]
        for linear in linears:
            linear.pack()
        return len(linears)

    def fuse_gelu(self) -> None:
        """Let oneDNN apply each MLP's GELU inside its first product (``Linear.forward_gelu``)."""
        for block in self.h:
            block.mlp.dense_h_to_4h.fuse_gelu = True

    def use_few_rows_kernel(self, kernel: Callable) -> int:
        """Send every product of at most ``FEW_ROWS`` rows through ``kernel`` (``cpu_kernel.py``):
        all of decode, and the prefill's LM head. Returns how many linears (with the LM head) use
        it: those whose weights suit it."""
        used = sum(m.use_few_rows(kernel) for m in self.h.modules() if isinstance(m, Linear))
        if cpu_kernel.suits(self.word_embeddings.weight):
            self.few_rows = kernel
            used += 1
        return used

    def use_cpu_decode_step(self, op: Callable | None) -> bool:
        """Run every decode step as one call of ``op`` (``csrc/decode_step.cpp``): the same
        computation and roundings as ``decode`` below, without ~120 Python-dispatched operations
        per step (for a small model, most of the step). Only in one process (no all-reduce there),
        after ``use_few_rows_kernel`` accepted every product's weight. Returns whether it is used."""
        linears = [m for m in self.h.modules() if isinstance(m, Linear)]
        if op is None or self.parallel.world_size > 1 or self.few_rows is None or any(m.few_rows is None for m in linears):
            return False
        weights = self.cpu_decode_weights()
        if any(w.dtype != weights[0].dtype or not w.is_contiguous() for w in weights):
            return False
        self._cpu_decode_weights = weights
        self.cpu_decode = op
        return True

    def cpu_decode_weights(self) -> list[torch.Tensor]:
        """The weights in the order ``csrc/decode_step.cpp`` reads them."""
        norm = lambda ln: [ln.weight, ln.bias]  # noqa: E731
        linear = lambda m: [m.weight, m.bias]  # noqa: E731
        weights = [self.word_embeddings.weight, *norm(self.word_embeddings_layernorm), *norm(self.ln_f)]
        for block in self.h:
            attention, mlp = block.self_attention, block.mlp
            weights += [*norm(block.input_layernorm), *linear(attention.query_key_value), *linear(attention.dense),
                        *norm(block.post_attention_layernorm), *linear(mlp.dense_h_to_4h), *linear(mlp.dense_4h_to_h)]
        return [w.detach() for w in weights]

    @contextmanager
    def op_by_op(self):
        """Within it, the one-call CPU steps (``cpu_decode``, ``prompt_attention``) are off and
        the steps run op by op from Python, as on the other devices: to compare the two."""
        saved = self.cpu_decode, self.prompt_attention
        self.cpu_decode = self.prompt_attention = None
        try:
            yield self
        finally:
            self.cpu_decode, self.prompt_attention = saved

    def lm_head(self, h):
        """Logits over the whole vocabulary [..., V] from final hidden states (tied embeddings)."""
        # One product per step: the per-call checks of cpu_kernel.linear cost nothing here.
        logits = cpu_kernel.linear(self.ln_f(h), self.word_embeddings.weight, None, self.few_rows)
        return self.parallel.all_gather_last(logits)

    def embed(self, ids):
        return self.word_embeddings_layernorm(self.word_embeddings(ids))

    def _prefill_hidden(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                        last_only: bool = False) -> torch.Tensor:
        """Final hidden states [B, P, hidden] of right-padded prompts; fills cache slots 0..P-1.

        ``last_only``: [B, 1, hidden], each row's last real token only. The last block then runs
        its attention output, dense and MLP for that token alone: a quarter of a block's
        products are the keys and values every position needs, the rest would be thrown away."""
        # The one-call prompt attention masks from ``lengths`` itself.
        hidden_mask = prompt_mask(lengths, input_ids.shape[1]) if self.prompt_attention is None else None
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)

        def keep_last(t):  # [B, P, ...] -> [B, 1, ...]: each row's last real token
            return t[rows, lengths - 1][:, None]

        h = self.embed(input_ids)
        for i, block in enumerate(self.h):
            keep = keep_last if last_only and i == len(self.h) - 1 else None
            h = block(h, lambda x, i=i, block=block, keep=keep: block.self_attention.prefill(
                x, i, cache, hidden_mask, keep, lengths, self.prompt_attention), keep)
        return h

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """input_ids [B, P] right-padded, lengths [B] real tokens per row -> logits [B, V].

        With ``trim_prefill`` (set by the backend on CPU and CUDA, where prefill is not captured)
        it runs over the first max(lengths) slots only. The static P is what a captured graph needs; an eager prefill gains nothing from the
        pad slots past the longest prompt: their keys and values are never attended (a row's
        decode writes each slot before it attends it), and the logits come from real tokens. A
        16-token prompt padded to 128 then costs a 16-token prefill. The step's signature (the
        shapes it is called with) stays [B, P]."""
        return self.lm_head(self._prefill_hidden(self.real_span(input_ids, lengths), lengths, cache, last_only=True)[:, 0])

    def real_span(self, input_ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """[B, P] right-padded ids cut to the longest real row [B, max(lengths)] where
        ``trim_prefill`` allows it (see ``prefill``); as they are otherwise."""
        return input_ids[:, : int(lengths.max())] if self.trim_prefill else input_ids

    def full_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits at every position [B, P, V]: for scoring prompts (log-probs, perplexity), not
        for generation, which only ever needs the last row of each prompt."""
        return self.lm_head(self._prefill_hidden(input_ids, lengths, cache))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """tokens [B, 1] written at slots positions [B]; attends slots < window -> logits [B, V]."""
        if self.cpu_decode is not None:
            return self.cpu_decode(self._cpu_decode_weights, tokens, positions, cache.keys, cache.values, cache.alibi,
                                   window, self.config.layer_norm_epsilon,
                                   self.config.apply_residual_connection_post_layernorm)
        b, heads = tokens.shape[0], self.local_heads
        slots = cache.slots[:window]
        hidden = (slots[None, :] > positions[:, None])[:, None, :].expand(b, heads, window).reshape(b * heads, window)
        # The mask is folded into the ALiBi bias once per step, for every layer: baddbmm then adds
        # the dtype's minimum to unseen slots, whose probability comes out exactly 0, as with
        # masking the scores afterwards (seen slots get the very same bias), minus one op per layer.
        alibi = cache.alibi[:, :, :window]
        masked_alibi = alibi.masked_fill(hidden[:, None, :], torch.finfo(alibi.dtype).min)  # [B*H, 1, W], row b*H+h
        h = self.embed(tokens)
        for i, block in enumerate(self.h):
            h = block(h, lambda x, i=i, block=block: block.self_attention.decode(x, i, cache, positions, window, masked_alibi))
        return self.lm_head(h[:, 0])
