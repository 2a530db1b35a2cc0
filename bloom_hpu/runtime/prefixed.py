"""A prefill that copies what the prefix cache holds of each prompt and computes only the rest.

For a batch of B prompts right-padded to P (``StepRunner.prefill_shared`` with the prompts' ids):

1. **Shared within the batch.** Whole blocks that two or more prompts of the batch start with, and
   that the pool does not hold yet, are computed once first: each such prefix is prefilled alone
   in a one-row cache of length P and stored. (A few-shot job's first batch then computes its
   examples once, not once per row.)
2. **Lookup.** Each prompt takes the longest run of its blocks the pool holds, and the leading
   part of a held block that continues them (``prefix_cache.py``, Partial blocks: the rest of a
   conversation's previous turn),
   short of its last token (a prompt's first token needs the logits of its last token, so at least
   that one is computed).
3. **Copy and extend.** If any prompt found blocks, they are copied into its cache row and every
   row's rest (right-padded to R, a power of two of at least ``MIN_REST``, below P) runs as one
   ``extend`` step of shape [B, R] attending to its copied slots. Otherwise, or when the longest
   rest would need R = P anyway, the batch is prefilled as usual.
4. **Store.** Every prompt's whole blocks that the pool lacks are copied from its cache row into it.

The numerics are those of the prefill: every key and value is one the same prompt computes alone
(a block is named by all the tokens before it: ``prefix_cache.py``), and ``extend`` attends with
the same ALiBi bias and mask. Shapes: (B, K) prefill, (B, K, R) extend for the few R buckets, and
(1, P) for shared prefixes; the pool's copies move as many blocks as the shape holds and end with
``mark_step``, so on a Gaudi each is one lazy graph per shape, whatever was found.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..kv_cache import KVCache
from .transfer import host_to_device

MIN_REST = 16  # the smallest rest bucket R
PAD = 0  # the id right-padding a rest (never attended, as any pad)


def rest_bucket(rest: int, prompt_len: int) -> int:
    """R for a longest rest of ``rest`` tokens: a power of two of at least MIN_REST, at most P."""
    return min(prompt_len, max(MIN_REST, 1 << (max(rest, 1) - 1).bit_length()))


def rest_buckets(prompt_len: int) -> list[int]:
    """Every R below P an extend of prompts padded to P can take (warm-up runs them)."""
    out, r = [], MIN_REST
    while r < prompt_len:
        out.append(r)
        r *= 2
    return out


def cacheable(length: int, block: int) -> int:
    """Tokens of a prompt of ``length`` the pool may serve: whole blocks, its last token left out."""
    return (length - 1) // block * block


def prefill_with_prefixes(runner, input_ids: torch.Tensor, lengths: torch.Tensor, cache: KVCache,
                          prompt_ids: list[list[int]], namespace: str = "", requests: int | None = None) -> torch.Tensor:
    """Logits [B, V] of each prompt's last token, as ``runner.prefill(input_ids, lengths, cache)``
    gives them, with what the prefix cache holds copied instead of computed. ``requests``: the
    leading rows that are prompts of their own (default all); the rows after them fill a static
    batch shape (the server's prefill buckets) and are neither counted as lookups nor stored."""
    pool = runner.prefix
    prompt_len = input_ids.shape[1]
    requests = len(prompt_ids) if requests is None else requests
    computed = _compute_shared_prefixes(runner, prompt_ids[:requests], prompt_len, namespace)
    limits = [len(ids) - 1 for ids in prompt_ids]  # whole blocks and a tail, short of the last token
    starts = copy_held(runner, cache, prompt_ids, limits, prompt_len, namespace, counted=requests, computed=computed)
    if starts is None:
        for ids in prompt_ids[:requests]:
            pool.match(ids, namespace, 0)  # counted as a lookup that found nothing used
        logits = runner.prefill(input_ids, lengths, cache)
        starts = [0] * len(prompt_ids)
    else:
        rest = rest_bucket(max(len(ids) - start for ids, start in zip(prompt_ids, starts)), prompt_len)
        logits = _extend(runner, prompt_ids, starts, rest, cache)
    for row, ids in enumerate(prompt_ids[:requests]):
        pool.store(cache, row, ids, len(ids), namespace, pad_to=prompt_len // pool.block)
        runner.backend.mark_step()
    pool.stats.per_call = [max(0, start - computed.get(row, 0)) for row, start in enumerate(starts)]
    return logits


def copy_held(runner, cache: KVCache, rows: list[list[int]], limits: list[int], span: int, namespace: str,
              counted: int | None = None, computed: dict[int, int] | None = None) -> list[int] | None:
    """Copy into row r of ``cache`` the blocks the pool holds of ``rows[r]`` (at most ``limits[r]``
    tokens), for rests padded below ``span``: the slots copied per row, or None (nothing copied)
    when the pool holds nothing of them or the longest rest would need a whole ``span`` anyway.
    Partial blocks are taken where copies may take any shape (not on a Gaudi: there the graph
    stand-in saw a repeated load compile new lazy graphs once partial hits turned a batch's
    prefill into an extend), their block's last slots clamped to the row
    (``PrefixCache._indices``). ``counted``: how many leading rows' lookups go into the pool's
    stats (default all; 0: none). ``computed``: {row: tokens of its prefix this call computed just
    before (``_compute_shared_prefixes``)}, counted as not cached."""
    pool = runner.prefix
    counted = len(rows) if counted is None else counted
    computed = computed or {}
    room = pool.partial_span(cache)
    partial = room > 0
    found = [pool.peek(ids, namespace, limit, partial, room) for ids, limit in zip(rows, limits)]
    if not any(found) or rest_bucket(max(len(ids) - n for ids, n in zip(rows, found)), span) >= span:
        return None
    held = [pool.lookup(ids, namespace, n, row < counted, partial, room, computed.get(row, 0))
            for row, (ids, n) in enumerate(zip(rows, found))]
    pool.copy_into(cache, [(row, i, j) for row, (chain, _) in enumerate(held) for i, j in enumerate(chain)],
                   pad_to=len(rows) * (span // pool.block))
    runner.backend.mark_step()  # the copy is a lazy graph of its own, whatever follows it
    return [tokens for _, tokens in held]


def _extend(runner, prompt_ids: list[list[int]], starts: list[int], rest: int, cache: KVCache) -> torch.Tensor:
    """One extend step over every row's tokens after ``starts``, right-padded to ``rest``."""
    device = cache.slots.device
    rows = [ids[start:] + [PAD] * (rest - len(ids) + start) for ids, start in zip(prompt_ids, starts)]
    lengths = [len(ids) - start for ids, start in zip(prompt_ids, starts)]
    return runner.extend(host_to_device(torch.tensor(rows, dtype=torch.long), device),
                         host_to_device(torch.tensor(starts, dtype=torch.long), device),
                         host_to_device(torch.tensor(lengths, dtype=torch.long), device), cache)


def _compute_shared_prefixes(runner, prompt_ids: list[list[int]], prompt_len: int, namespace: str) -> dict[int, int]:
    """Store the whole blocks two or more of the prompts start with, each such prefix computed once.
    Returns {row: tokens computed}, the row each computation was made for: its lookup counts those
    tokens as computed, not cached, so a prefix costs one miss whether its prompts come together
    or one by one (the others that share it count a hit, as they would after it)."""
    pool = runner.prefix
    computed = {}
    if len(prompt_ids) < 2:
        return computed
    chains = [pool.digests(ids, namespace, cacheable(len(ids), pool.block)) for ids in prompt_ids]
    shared = Counter(digest for chain in chains for digest in chain)
    prefixes = {}  # the deepest shared digest of each prompt -> (prompt, tokens up to it)
    for row, chain in enumerate(chains):
        depth = max((i for i, digest in enumerate(chain) if shared[digest] > 1), default=None)
        if depth is not None:
            prefixes.setdefault(chain[depth], (row, (depth + 1) * pool.block))
    for row, upto in sorted(prefixes.values(), key=lambda p: -p[1]):  # the longest first: it stores the others' blocks
        ids = prompt_ids[row][:upto]
        held_before = pool.peek(ids, namespace)
        if held_before >= upto:
            continue
        computed[row] = upto - held_before
        one = runner.cache(1, prompt_len)
        held = copy_held(runner, one, [ids], [cacheable(upto, pool.block)], prompt_len, namespace, counted=0)
        if held is None:  # nothing held, or a rest as long as the prompt: the prefix alone, prefilled
            padded = ids + [PAD] * (prompt_len - upto)
            runner.prefill(host_to_device(torch.tensor([padded], dtype=torch.long), one.slots.device),
                           host_to_device(torch.tensor([upto], dtype=torch.long), one.slots.device), one)
        else:
            _extend(runner, [ids], held, rest_bucket(upto - held[0], prompt_len), one)
        pool.store(one, 0, ids, upto, namespace, pad_to=prompt_len // pool.block)
        runner.backend.mark_step()
    return computed
