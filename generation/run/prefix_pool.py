"""The prefix cache as the generator offers it: its size as the user gives it (``--prefix_cache``),
the memory check before the pool is allocated, and what a generate call leaves in it.

The pool and its index are ``bloom_hpu/prefix_cache.py``, owned by the generator's ``StepRunner``
(made there, paused and namespaced through its methods); the prefill that uses them is
``bloom_hpu/runtime/prefixed.py``. A generator with a pool uses it for every prompt it prefills
(``generate``, request files, the chat shell, the server); scoring passes (``--eval``, ``echo``
with log-probs) need every position's logits and compute their prompts in full.
"""

from __future__ import annotations

import re

from bloom_hpu.prefix_cache import DEFAULT_BLOCK, PrefixCache, block_bytes

from ..request.memory import MemoryCheckError, agreed_free_bytes, human

DEFAULT_SIZE = "1GB"  # the CLI's, the server's and the chat shell's default; the library's is off
UNITS = {"": 1 << 20, "b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "kib": 1 << 10, "mib": 1 << 20,
         "gib": 1 << 30}


class PrefixCacheError(ValueError):
    """A prefix cache size that cannot be used; one line for the user."""


def parse_size(size: int | str | None) -> int:
    """Bytes of ``size``: an int (bytes), or a string such as "512MB", "2GB", "1.5GiB" or "256"
    (a bare number is MB); 0 or None: no cache."""
    if size is None:
        return 0
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise PrefixCacheError(f"prefix cache size must be a number of bytes or a string like '512MB', got {size!r}")
    if isinstance(size, int):
        value = size
    else:
        found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", size)
        if not found or found.group(2).lower() not in UNITS:
            raise PrefixCacheError(f"prefix cache size {size!r} is not a size: give e.g. 512MB, 2GB or 0 (off)")
        value = int(float(found.group(1)) * UNITS[found.group(2).lower()])
    if value < 0:
        raise PrefixCacheError(f"prefix cache size must be at least 0, got {size!r}")
    return value


def enable_prefix_cache(generator, nbytes: int | None, block: int = DEFAULT_BLOCK) -> PrefixCache | None:
    """Give ``generator``'s runner a pool of ``nbytes`` (as ``parse_size`` gives it), checked
    against the free memory before it is allocated; None (and no pool) for 0 or None."""
    nbytes = nbytes or 0
    model = generator.model
    per_block = block_bytes(model.config, generator.dtype, model.parallel.world_size, block)
    capacity = nbytes // per_block
    if nbytes and capacity < 1:
        raise PrefixCacheError(f"a prefix cache of {human(nbytes)} holds no block: one block of {block} tokens "
                               f"takes {human(per_block)} for this model; give at least that, or 0 (off)")
    free = agreed_free_bytes(generator.device, model.parallel) if capacity else None
    if free is not None and capacity * per_block > free:
        raise MemoryCheckError(f"a prefix cache of {human(capacity * per_block)} does not fit: {human(free)} is free "
                               f"on {generator.device.type}; lower --prefix_cache (0: off)")
    return generator.runner.enable_prefix_cache(capacity, block)


def store_generated(generator, cache, prompt_ids: list[list[int]], sequences: list[list[int]]) -> None:
    """After a token loop: keep each row's prompt and generated tokens that its cache row holds
    (every token but the last generated one was fed back), whole blocks and the last partial one
    (a tail), so that a conversation's next turn, which repeats them, computes only what it adds."""
    pool = generator.runner.prefix
    if pool is None:
        return
    for row, (ids, new) in enumerate(zip(prompt_ids, sequences)):
        if len(new) > 1:
            full = list(ids) + list(new)
            pool.store(cache, row, full, len(full) - 1, generator.runner.prefix_namespace,
                       pad_to=cache.length // pool.block, tail=True)
            generator.backend.mark_step()


def cached_counts(generator, rows: int) -> list[int]:
    """Prompt tokens of each of the last prefill's ``rows`` prompts that came from the pool."""
    pool = generator.runner.prefix
    if pool is None or len(pool.stats.per_call) != rows:
        return [0] * rows
    return list(pool.stats.per_call)
