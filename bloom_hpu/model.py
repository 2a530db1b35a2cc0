"""BLOOM rewritten for static shapes.

The entry points, all with shapes fixed in advance:

* ``prefill(input_ids [B, P], lengths [B], cache)``: prompts right-padded to P; writes the KV cache
  slots 0..P-1 and returns the logits of each row's last real token only ([B, V]; the full
  [B, P, V] logits are never built).
* ``decode(tokens [B, 1], positions [B], cache, window)``: one new token per row, written into the
  cache at the row's own slot; attends over the first ``window`` slots ([B, V] logits).
* ``mixed(tokens, positions, chunk [1, C], chunk_row, chunk_start, chunk_len, cache, window)``: a
  decode step that also carries C tokens of one row's prompt (the server's prefill in chunks).
* ``extend(input_ids [B, R], starts [B], lengths [B], cache, window)``: prompts continued after
  slots already in the cache (copied there by the prefix cache); [B, V] logits, as ``prefill``.

Module and parameter names follow the transformers checkpoints (``h.0.self_attention.dense``...), so
weights load by name. Tensor parallelism enters through ``parallel`` and the two parallel layers of
``tp.py``: each rank holds ``n_head / world`` heads and slices of the MLP and the vocabulary, and
the row-parallel linears finish with an all-reduce. With one process those calls are no-ops.

Nothing here knows the device: graph capture, trimming a prefill to its longest prompt and the CPU
kernels are the runtime's (``runtime/``), applied to a finished model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .alibi import alibi_slopes
from .config import BloomConfig
from .kv_cache import KVCache
from .tp import SINGLE, Parallel, RowParallelLinear, VocabParallelEmbedding


class Linear(nn.Linear):
    """``nn.Linear`` whose product is one method, so that a runtime can give it another kernel
    (``runtime/cpu/layers.py``) without touching the model."""

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.bias)


class TiedHead(nn.Module):
    """The LM head: logits from final hidden states with the word embeddings' weight (BLOOM ties
    them). A module of its own, with no weight of its own, so a runtime can swap its product."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight)


class Prompt:
    """What a prefill's attention needs to know of right-padded prompts: ``lengths`` [B] real
    tokens per row, the padded length P, and (built on first use) the [B, 1, P, P] mask."""

    def __init__(self, lengths: torch.Tensor, length: int):
        self.lengths = lengths
        self.length = length
        self._mask = None
        self._rows = torch.arange(lengths.shape[0], device=lengths.device)

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = prompt_mask(self.lengths, self.length)
        return self._mask

    def keep_last(self, t: torch.Tensor) -> torch.Tensor:
        """[B, P, ...] -> [B, 1, ...]: each row's last real token."""
        return t[self._rows, self.lengths - 1][:, None]


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

    def prefill(self, x, layer: int, cache: KVCache, prompt: Prompt, last_only: bool = False):
        """Keys and values of every position go to the cache; with ``last_only`` the queries, and
        so the output [B, 1, hidden], are each row's last real token only."""
        return self.dense(self.attend_prompt(self.query_key_value(x), layer, cache, prompt, last_only))

    def attend_prompt(self, qkv, layer: int, cache: KVCache, prompt: Prompt, last_only: bool = False):
        """The attention between a prefill's two products: qkv [B, P, H*3*D] -> context
        [B, P or 1, H*D]. Pad positions attend every real key of their row (finite, never used)."""
        q, k, v = self._split_heads(qkv)
        cache.write_prefix(layer, k, v)
        p = qkv.shape[1]
        hidden_mask = prompt.mask
        if last_only:  # [B, H, P, ...] -> [B, H, 1, ...], picked along the positions
            q = prompt.keep_last(q.transpose(1, 2)).transpose(1, 2)
            hidden_mask = prompt.keep_last(hidden_mask.transpose(1, 2)).transpose(1, 2)
        return self._attend(q, k, v, cache.alibi[:, :, :p], hidden_mask)

    def decode(self, x, layer: int, cache: KVCache, positions, window: int, masked_alibi):
        """``masked_alibi`` [B*H, 1, W]: the ALiBi bias with unseen slots at the dtype's minimum."""
        q, k, v = self._split_heads(self.query_key_value(x))
        cache.write_at(layer, positions, k, v)
        keys = cache.keys[layer][:, :, :window]
        values = cache.values[layer][:, :, :window]
        return self.dense(self._attend(q, keys, values, masked_alibi))


    def extend(self, x, layer: int, cache: KVCache, slots, window: int, bias, last=None):
        """Prompts continued in every row of the cache: x [B, R, hidden], row b's tokens going to
        ``slots[b]`` [R] and attending its first ``window`` slots with ``bias`` [B*H, R, W] (ALiBi
        with the causal mask folded in). ``last`` [B]: only those positions' queries, and so the
        output [B, 1, hidden]."""
        q, k, v = self._split_heads(self.query_key_value(x))  # [B, H, R, D]
        b = q.shape[0]
        cache.write_span(layer, cache.rows[:b], slots, k, v)
        if last is not None:
            q = q[cache.rows[:b], :, last][:, :, None]  # [B, H, 1, D]
            bias = bias.view(b, self.n_head, -1, window)[cache.rows[:b], :, last].reshape(b * self.n_head, 1, window)
        return self.dense(self._attend(q, cache.keys[layer][:, :, :window], cache.values[layer][:, :, :window], bias))

    def mixed(self, x, layer: int, cache: KVCache, positions, window: int, masked_alibi, chunk_rows, chunk_slots,
              chunk_bias):
        """A decode step of b rows with S prompt segments of C tokens: x [b + S*C, 1, hidden], the
        b decode tokens first. One product for all; then the decode tokens attend as in ``decode``
        and segment s as a prompt continued in row ``chunk_rows[s]``: its keys and values go to
        ``chunk_slots[s]`` [C], its queries attend that row's first ``window`` slots with
        ``chunk_bias[s]`` [H, C, W] (ALiBi with the causal mask folded in)."""
        b, segments = positions.shape[0], chunk_slots.shape[0]
        qkv = self.query_key_value(x)  # [b + S*C, 1, 3*H*D]
        q, k, v = self._split_heads(qkv[:b])
        cq, ck, cv = self._split_heads(qkv[b:].reshape(segments, -1, qkv.shape[-1]))  # [S, H, C, D]
        # The decode writes first: a row still being prefilled decodes a filler token at the slot
        # its next segment starts at (engine.py), which the segment's own write then replaces.
        # Every segment writes before any attends, so a prompt's later segment in the same step
        # sees its earlier ones.
        cache.write_at(layer, positions, k, v)
        cache.write_span(layer, chunk_rows, chunk_slots, ck, cv)
        context = self._attend(q, cache.keys[layer][:, :, :window], cache.values[layer][:, :, :window], masked_alibi)
        row_keys, row_values = cache.row_window(layer, chunk_rows, window)
        chunk_context = self._attend(cq, row_keys, row_values, chunk_bias)  # [S, C, H*D]
        return self.dense(torch.cat([context, chunk_context.reshape(-1, 1, chunk_context.shape[-1])]))

    def verify_mixed(self, x, layer: int, cache: KVCache, row_slots, window: int, row_bias, chunk_rows, chunk_slots,
                     chunk_bias):
        """``mixed`` with S tokens for each of the b rows (a verify pass: the last token and the
        guesses): x [b*S + G*C, 1, hidden], row b's tokens going to ``row_slots[b]`` [S] and attending
        its first ``window`` slots with ``row_bias`` [b*H, S, W] (as ``extend``); the G segments as
        in ``mixed``. The rows write first, as there."""
        b, s = row_slots.shape
        qkv = self.query_key_value(x)  # [b*S + G*C, 1, 3*H*D]
        q, k, v = self._split_heads(qkv[: b * s].reshape(b, s, -1))  # [b, H, S, D]
        cq, ck, cv = self._split_heads(qkv[b * s :].reshape(chunk_slots.shape[0], -1, qkv.shape[-1]))
        cache.write_span(layer, cache.rows[:b], row_slots, k, v)
        cache.write_span(layer, chunk_rows, chunk_slots, ck, cv)
        context = self._attend(q, cache.keys[layer][:, :, :window], cache.values[layer][:, :, :window], row_bias)
        row_keys, row_values = cache.row_window(layer, chunk_rows, window)
        chunk_context = self._attend(cq, row_keys, row_values, chunk_bias)  # [G, C, H*D]
        width = context.shape[-1]
        return self.dense(torch.cat([context.reshape(-1, 1, width), chunk_context.reshape(-1, 1, width)]))


class MLP(nn.Module):
    def __init__(self, config: BloomConfig, parallel: Parallel):
        super().__init__()
        local_ffn = 4 * config.hidden_size // parallel.world_size
        self.dense_h_to_4h = Linear(config.hidden_size, local_ffn)
        self.gelu = nn.GELU(approximate="tanh")
        self.dense_4h_to_h = RowParallelLinear(local_ffn, config.hidden_size, parallel)

    def forward(self, x):
        return self.dense_4h_to_h(self.gelu(self.dense_h_to_4h(x)))


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


def prompt_mask(lengths: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """[B, 1, P, P] bool, True where query q of a right-padded prompt must not see key k."""
    slots = torch.arange(prompt_len, device=lengths.device)
    # A query at q sees keys k <= q that are real tokens of its row. Pad queries (q >= length)
    # still see every real key, so no row of the softmax is empty.
    causal = slots[None, :] > slots[:, None]  # [P(q), P(k)]
    padding = slots[None, :] >= lengths[:, None]  # [B, P(k)]
    return causal[None, None] | padding[:, None, None, :]


class StaticBloom(nn.Module):
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
        self.head = TiedHead()
        local_heads = config.n_head // parallel.world_size
        first = parallel.rank * local_heads
        # This rank's heads' slopes; a buffer so .to(device) moves it, not saved in checkpoints.
        self.register_buffer(
            "slopes", alibi_slopes(config.n_head)[first : first + local_heads], persistent=False
        )

    @property
    def local_heads(self) -> int:
        return self.config.n_head // self.parallel.world_size

    def allocate_cache(self, batch_size: int, length: int, per_layer: bool = False) -> KVCache:
        """``per_layer``: one cache tensor per layer, written whole (kv_cache.py; for HPU graphs)."""
        p = self.ln_f.weight  # the activations' dtype and device (never a quantized weight)
        return KVCache.allocate(
            self.config.n_layer, batch_size, self.local_heads, length, self.config.head_dim,
            self.slopes, p.dtype, p.device, per_layer,
        )

    def lm_head(self, h):
        """Logits over the whole vocabulary [..., V] from final hidden states (tied embeddings)."""
        logits = self.head(self.ln_f(h), self.word_embeddings.weight)  # [..., this rank's shard]
        return self.parallel.all_gather_last(logits, self.config.vocab_size)

    def embed(self, ids):
        return self.word_embeddings_layernorm(self.word_embeddings(ids))

    def hidden_states(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                      last_only: bool = False) -> torch.Tensor:
        """Final hidden states [B, P, hidden] of right-padded prompts [B, P]; fills cache slots 0..P-1.

        ``last_only``: [B, 1, hidden], each row's last real token only. The last block then runs
        its attention output, dense and MLP for that token alone: a quarter of a block's
        products are the keys and values every position needs, the rest would be thrown away."""
        prompt = Prompt(lengths, input_ids.shape[1])
        h = self.embed(input_ids)
        for i, block in enumerate(self.h):
            last = last_only and i == len(self.h) - 1
            h = block(h, lambda x, i=i, block=block, last=last: block.self_attention.prefill(x, i, cache, prompt, last),
                      prompt.keep_last if last else None)
        return h

    def prefill(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """input_ids [B, P] right-padded, lengths [B] real tokens per row -> logits [B, V] of each
        row's last real token (the full [B, P, V] logits are never built)."""
        return self.lm_head(self.hidden_states(input_ids, lengths, cache, last_only=True)[:, 0])

    def full_logits(self, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits at every position [B, P, V]: for scoring prompts (log-probs, perplexity), not
        for generation, which only ever needs the last row of each prompt."""
        return self.lm_head(self.hidden_states(input_ids, lengths, cache))

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """tokens [B, 1] written at slots positions [B]; attends slots < window -> logits [B, V]."""
        masked_alibi = self._decode_bias(positions, cache, window)
        h = self.embed(tokens)
        for i, block in enumerate(self.h):
            h = block(h, lambda x, i=i, block=block: block.self_attention.decode(x, i, cache, positions, window, masked_alibi))
        return self.lm_head(h[:, 0])

    def _decode_bias(self, positions: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """[B*H, 1, W]: the ALiBi bias of one token per row at ``positions``, with unseen slots at
        the dtype's minimum."""
        b, heads = positions.shape[0], self.local_heads
        slots = cache.slots[:window]
        hidden = (slots[None, :] > positions[:, None])[:, None, :].expand(b, heads, window).reshape(b * heads, window)
        # The mask is folded into the ALiBi bias once per step, for every layer: baddbmm then adds
        # the dtype's minimum to unseen slots, whose probability comes out exactly 0, as with
        # masking the scores afterwards (seen slots get the very same bias), minus one op per layer.
        alibi = cache.alibi[:, :, :window]
        return alibi.masked_fill(hidden[:, None, :], torch.finfo(alibi.dtype).min)  # [B*H, 1, W], row b*H+h

    def extend(self, input_ids: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
               window: int) -> torch.Tensor:
        """Prompts whose first ``starts[b]`` slots are already in the cache (a prefix cache's hit),
        continued: input_ids [B, R] right-padded after ``lengths[b]`` real tokens go to slots
        starts[b] .. and attend every slot below ``window`` up to their own. Returns the logits
        [B, V] of each row's last real token, as ``prefill`` does for the whole prompt.

        Pad tokens write the slots after the real ones (clamped to the cache), which nothing
        attends before the row writes them again."""
        return self.lm_head(self.extend_hidden(input_ids, starts, cache, window, last=lengths - 1)[:, 0])

    def extend_hidden(self, input_ids: torch.Tensor, starts: torch.Tensor, cache: KVCache, window: int,
                      last: torch.Tensor | None = None) -> torch.Tensor:
        """``extend``'s final hidden states: [B, R, hidden] at every position (scoring the rest of
        rows whose start the cache holds), or [B, 1, hidden] at ``last`` [B]."""
        b, r, heads = input_ids.shape[0], input_ids.shape[1], self.local_heads
        slots = (starts[:, None] + cache.slots[None, :r]).clamp(max=cache.length - 1)  # [B, R]
        hidden = cache.slots[None, None, :window] > slots[:, :, None]  # [B, R, W]: not yet seen
        alibi = cache.alibi[:heads, :, :window]  # [H, 1, W]: the same for every row
        bias = alibi[None].masked_fill(hidden[:, None], torch.finfo(alibi.dtype).min).reshape(b * heads, r, window)
        h = self.embed(input_ids)
        for i, block in enumerate(self.h):
            picks = last if last is not None and i == len(self.h) - 1 else None
            h = block(h, lambda x, i=i, block=block, picks=picks: block.self_attention.extend(
                x, i, cache, slots, window, bias, picks),
                (lambda t, picks=picks: t[cache.rows[:b], picks][:, None]) if picks is not None else None)
        return h

    def mixed(self, tokens: torch.Tensor, positions: torch.Tensor, chunk: torch.Tensor, chunk_rows: torch.Tensor,
              chunk_start: torch.Tensor, chunk_len: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """A decode step with prompt segments in it: one read of the weights serves both.

        tokens [B, 1] at positions [B], as ``decode``; chunk [S, C] ids: segment s, right-padded
        after ``chunk_len[s]`` real ones, continues the prompt of cache row ``chunk_rows[s]`` from
        slot ``chunk_start[s]`` (that row's earlier slots hold the prompt's start; a prompt may
        take several segments of one step). Every slot attended is below ``window``. Returns
        logits [B + S, V]: the B rows', then each segment's last real token's (a prompt's first
        token's logits when the segment ends it).

        A segment's pad tokens write the slots after its real ones (clamped to the cache), which
        nothing attends before the row writes them again. An unused segment repeats a used one
        (same row, slots and ids): it writes the same values again."""
        b, c, heads = tokens.shape[0], chunk.shape[1], self.local_heads
        masked_alibi = self._decode_bias(positions, cache, window)
        chunk_slots, keep = segment_layout(b, chunk_start, chunk_len, c, cache)
        # Token i of segment s sees its row's slots <= chunk_start[s] + i (causal, earlier segments included).
        hidden = cache.slots[None, None, :window] > chunk_slots[:, :, None]  # [S, C, W]
        alibi = cache.alibi[:heads, :, :window]  # [H, 1, W]: the bias is the same for every row
        chunk_bias = alibi[None].masked_fill(hidden[:, None], torch.finfo(alibi.dtype).min)  # [S, H, C, W]
        chunk_bias = chunk_bias.reshape(-1, c, window)  # [S*H, C, W], as _attend takes it
        h = self.embed(torch.cat([tokens[:, 0], chunk.reshape(-1)])[:, None])  # [B + S*C, 1, hidden]: one token per row
        for i, block in enumerate(self.h):
            h = block(h, lambda x, i=i, block=block: block.self_attention.mixed(
                x, i, cache, positions, window, masked_alibi, chunk_rows, chunk_slots, chunk_bias))
        return self.lm_head(h[:, 0].index_select(0, keep))


    def verify_mixed(self, ids: torch.Tensor, starts: torch.Tensor, chunk: torch.Tensor, chunk_rows: torch.Tensor,
                     chunk_start: torch.Tensor, chunk_len: torch.Tensor, cache: KVCache, window: int) -> torch.Tensor:
        """A verify pass with prompt segments in it (the server speculating while prompts join):
        ids [B, S] written from slots ``starts`` [B], each position attending its row's slots up to
        its own (as ``extend_hidden``), and the segments [G, C] as in ``mixed``. Returns logits
        [B*S + G, V]: every position of the rows (row-major), then each segment's last real token's."""
        b, s, heads = ids.shape[0], ids.shape[1], self.local_heads
        row_slots = (starts[:, None] + cache.slots[None, :s]).clamp(max=cache.length - 1)  # [B, S]
        alibi = cache.alibi[:heads, :, :window]  # [H, 1, W]: the same for every row
        hidden = cache.slots[None, None, :window] > row_slots[:, :, None]  # [B, S, W]: not yet seen
        row_bias = alibi[None].masked_fill(hidden[:, None], torch.finfo(alibi.dtype).min).reshape(b * heads, s, window)
        c = chunk.shape[1]
        chunk_slots, _ = segment_layout(0, chunk_start, chunk_len, c, cache)
        hidden = cache.slots[None, None, :window] > chunk_slots[:, :, None]  # [G, C, W]
        chunk_bias = alibi[None].masked_fill(hidden[:, None], torch.finfo(alibi.dtype).min).reshape(-1, c, window)
        segment_ends = b * s - 1 + chunk_len + c * torch.arange(chunk.shape[0], device=ids.device)
        keep = torch.cat([torch.arange(b * s, device=ids.device), segment_ends])
        h = self.embed(torch.cat([ids.reshape(-1), chunk.reshape(-1)])[:, None])  # [B*S + G*C, 1, hidden]
        for i, block in enumerate(self.h):
            h = block(h, lambda x, i=i, block=block: block.self_attention.verify_mixed(
                x, i, cache, row_slots, window, row_bias, chunk_rows, chunk_slots, chunk_bias))
        return self.lm_head(h[:, 0].index_select(0, keep))


def segment_layout(b: int, chunk_start: torch.Tensor, chunk_len: torch.Tensor, c: int,
                   cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a mixed step's S prompt segments of C tokens go, its tokens being the B decode tokens
    then the segments' in order: (chunk_slots [S, C], each token's cache slot (pad tokens' clamped
    to the cache), keep [B + S], the tokens whose logits the step returns: the B rows' and each
    segment's last real one)."""
    chunk_slots = (chunk_start[:, None] + cache.slots[None, :c]).clamp(max=cache.length - 1)
    segment_ends = b - 1 + chunk_len + c * cache.slots[: chunk_start.shape[0]]  # (slots: 0, 1, ..., no new tensor)
    return chunk_slots, torch.cat([cache.rows[:b], segment_ends])
