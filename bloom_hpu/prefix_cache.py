"""The prefix cache: keys and values of prompt prefixes seen before, kept in a preallocated pool of
fixed-size blocks, so that a prompt that starts like an earlier one copies them instead of
computing them again.

* **Blocks.** A prompt's tokens are cut into blocks of ``block`` tokens; only whole blocks are
  kept. Block i of a prompt is named by a digest of everything up to its end (the namespace, then
  every token of blocks 0..i), so a block matches only where the whole prefix before it matches: in
  BLOOM a position's keys and values depend on every earlier token and on nothing after it (ALiBi
  adds position only to the scores, never to the keys), so the same prefix has the same keys and
  values at the same slots, whatever follows.
* **Partial blocks.** The leading part of a held block is valid for any prompt that agrees with
  it that far (its keys and values depend only on the tokens before them). A ``partial`` lookup,
  having matched whole blocks, takes the block under them that agrees longest with what follows.
  A sequence stored with ``tail=True`` (what a conversation's turn leaves: its prompt and reply,
  which the next turn repeats) also keeps its last n < ``block`` tokens, a tail, in a block of its
  own; a longer tail of the same prefix replaces a shorter one it extends. So the next turn
  computes only what it adds. Prompts of a request file or a server store whole blocks only, and
  on a Gaudi (fixed copy shapes) lookups and stores keep to whole blocks.
* **Namespace.** What else changes the keys and values of the same tokens: the LoRA adapter a row
  runs with. The weights' dtype and quantization are the generator's, fixed for the pool's life.
* **Pool.** Keys and values of ``capacity`` blocks, allocated once, in the layout of the KV cache
  (``kv_cache.py``): stacked [n_layer, blocks*H*block, D] on the CPU and CUDA, one flat
  [blocks*H*block, D] tensor per layer on a Gaudi. A block is [H, block, D] there, so copying
  blocks into cache rows, and back, is one ``index_select`` and one ``index_copy_`` of whole
  tensors per layer (or for all layers at once): no view is written, so HPU graphs captured on the
  cache stay valid, and the copies never run inside a captured step.
* **Eviction.** Least recently used first, with a prefix's blocks ordered so that what goes first
  is what can least be missed. A lookup and a store touch a prefix's blocks deepest first, so a
  block is always used more recently than its descendants: a stored prefix's deepest block is its
  least recent, the leaves go before the trunk, and the prefix shortens from its end (a match
  walks from block 0, so a prefix without its first block matches nothing, however much of the
  rest is held). A block whose parent did go anyway can never match again until that parent is
  stored again: it goes first. Blocks of the prefix being stored (``protected``) are never evicted
  for it.
* **Static shapes.** On a backend that compiles each new shape of eager ops (a Gaudi's lazy mode),
  a copy always moves as many blocks as its caller's shape can hold (``pad_to``: the rows times the
  blocks of the padded prompt), the last block's copy repeated (the same values to the same place
  again): the ops' shapes then follow the prefill's shape, never what was found.

The pool knows nothing of prompts beyond token ids; what to look up and when to copy is the
runtime's (``runtime/prefixed.py``).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache
from .runtime.transfer import host_to_device

DEFAULT_BLOCK = 32  # tokens per block: the shape multiple of request batches (jobs) too


def block_bytes(config, dtype: torch.dtype, world_size: int = 1, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one block takes in a rank's pool (its share of the heads): keys and values of every layer."""
    item = torch.empty((), dtype=dtype).element_size()
    return 2 * config.n_layer * (config.hidden_size // world_size) * block * item


@dataclass
class PrefixStats:
    """Counters since the pool was made (the server exports them on /metrics)."""

    lookups: int = 0  # prompts looked up
    hits: int = 0  # prompts that found blocks they did not compute themselves
    cached_tokens: int = 0  # prompt tokens copied from the pool instead of computed
    looked_up_tokens: int = 0  # prompt tokens of every lookup
    stored_blocks: int = 0
    evicted_blocks: int = 0
    per_call: list[int] = field(default_factory=list)  # cached tokens of each prompt of the last prefill


def _agreeing(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    def __init__(self, n_layer: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, per_layer: bool = False, block: int = DEFAULT_BLOCK,
                 fixed_copy_shapes: bool = False):
        if capacity < 1:
            raise ValueError("a prefix cache needs at least one block")
        self.block = block
        self.capacity = capacity
        self.heads = heads
        self.fixed_copy_shapes = fixed_copy_shapes
        self.device = torch.device(device)
        flat = capacity * heads * block
        # Uninitialised: a block is read only after it was written (a padded copy repeats a real
        # one), and on a CPU the pages of a large empty tensor are taken only as blocks are written.
        if per_layer:
            self.keys = tuple(torch.empty(flat, head_dim, dtype=dtype, device=device) for _ in range(n_layer))
            self.values = tuple(torch.empty(flat, head_dim, dtype=dtype, device=device) for _ in range(n_layer))
        else:
            self.keys = torch.empty(n_layer, flat, head_dim, dtype=dtype, device=device)
            self.values = torch.empty(n_layer, flat, head_dim, dtype=dtype, device=device)
        self.per_layer = per_layer
        self._blocks: OrderedDict[bytes, int] = OrderedDict()  # digest -> block, least recently used first
        # The tree of held blocks: a block's parent is the block before it in its prefix (a first
        # block's, the namespace's root key). Tails are blocks too, leaves of the tree.
        self._children: dict[bytes, set[bytes]] = {}  # digest -> its held children's digests
        self._parent: dict[bytes, bytes] = {}  # digest -> its parent's, while that is held
        self._tokens: dict[bytes, tuple[int, ...]] = {}  # digest -> the tokens its block holds
        self._free = list(range(capacity - 1, -1, -1))
        self.stats = PrefixStats()

    @classmethod
    def for_model(cls, model, capacity: int, per_layer: bool, fixed_copy_shapes: bool,
                  block: int = DEFAULT_BLOCK) -> "PrefixCache":
        p = model.ln_f.weight  # the activations' dtype and device, as the KV cache's
        return cls(model.config.n_layer, model.local_heads, model.config.head_dim, capacity, p.dtype, p.device,
                   per_layer, block, fixed_copy_shapes)

    @property
    def used_blocks(self) -> int:
        return len(self._blocks)

    @property
    def nbytes(self) -> int:
        tensors = self.keys + self.values if self.per_layer else (self.keys, self.values)
        return sum(t.nbytes for t in tensors)

    # ------------------------------------------------------------------ the index (host only)

    def digests(self, ids: list[int], namespace: str = "", upto: int | None = None) -> list[bytes]:
        """The digest of each whole block of ``ids[:upto]``, in order."""
        end = len(ids) if upto is None else min(upto, len(ids))
        h = hashlib.blake2b(namespace.encode(), digest_size=16)
        out = []
        for start in range(0, end - self.block + 1, self.block):
            h.update(b"".join(t.to_bytes(4, "little") for t in ids[start:start + self.block]))
            out.append(h.copy().digest())
        return out

    def lookup(self, ids: list[int], namespace: str = "", limit: int | None = None, count: bool = True,
               partial: bool = False, span: int | None = None, computed: int = 0) -> tuple[list[int], int]:
        """Pool blocks of the longest held prefix of ``ids`` of at most ``limit`` tokens, in order
        (touched as used), and how many tokens they hold: whole blocks, and with ``partial`` the
        leading part of the block under them that agrees longest with what follows (its block
        last). ``span``: the slots of the row the blocks go to (a partial block must fit in it).
        ``count``: one lookup of ``len(ids)`` tokens in the stats, of which ``computed`` (stored
        for this prompt a moment ago) are not counted as cached (a hit: at least one cached token)."""
        found, tokens = self._held(ids, namespace, limit, partial, span)
        self._touch([digest for digest, _ in found])
        if count:
            cached = max(0, tokens - computed)
            self.stats.lookups += 1
            self.stats.looked_up_tokens += len(ids)
            self.stats.hits += cached > 0
            self.stats.cached_tokens += cached
        return [block for _, block in found], tokens

    def match(self, ids: list[int], namespace: str = "", limit: int | None = None, count: bool = True) -> list[int]:
        """``lookup``'s whole blocks."""
        return self.lookup(ids, namespace, limit, count)[0]

    def peek(self, ids: list[int], namespace: str = "", limit: int | None = None, partial: bool = False,
             span: int | None = None) -> int:
        """Tokens of ``ids`` the pool holds as a prefix (at most ``limit``), as ``lookup`` finds
        them, without touching or counting."""
        return self._held(ids, namespace, limit, partial, span)[1]

    def _held(self, ids: list[int], namespace: str, limit: int | None, partial: bool,
              span: int | None) -> tuple[list[tuple[bytes, int]], int]:
        end = len(ids) if limit is None else min(limit, len(ids))
        found = []
        for digest in self.digests(ids, namespace, end):
            block = self._blocks.get(digest)
            if block is None:
                break
            found.append((digest, block))
        start = len(found) * self.block
        if not partial or end <= start or (span is not None and start + self.block > span):
            return found, start
        want = ids[start:end]
        best, agreed = None, 0
        for child in self._children.get(found[-1][0] if found else self._root(namespace), ()):
            n = _agreeing(self._tokens[child], want)
            if n > agreed:
                best, agreed = child, n
        if best is None:
            return found, start
        return found + [(best, self._blocks[best])], start + agreed

    def _root(self, namespace: str) -> bytes:
        """The key of the empty prefix (a tail of a sequence shorter than a block hangs under it)."""
        return hashlib.blake2b(b"root:" + namespace.encode(), digest_size=16).digest()

    def _touch(self, chain: list[bytes]) -> None:
        """Mark the held prefix ``chain`` (digests of blocks 0..n-1) used: deepest first, so that the
        trunk ends up the most recent and every block stays more recent than its descendants."""
        for digest in reversed(chain):
            self._blocks.move_to_end(digest)

    def _claim(self, protected: set[int]) -> int | None:
        """A free block, else the least recently used one that is not in ``protected`` (evicted), else None."""
        if self._free:
            return self._free.pop()
        victim = next((digest for digest, block in self._blocks.items() if block not in protected), None)
        if victim is None:
            return None
        return self._evict(victim)

    def _evict(self, digest: bytes) -> int:
        """Drop ``digest`` from the index; its held children can no longer match: they go first."""
        self.stats.evicted_blocks += 1
        return self._forget(digest)

    def _forget(self, digest: bytes) -> int:
        block = self._blocks.pop(digest)
        del self._tokens[digest]
        parent = self._parent.pop(digest, None)
        if parent is not None:
            self._children[parent].discard(digest)
        for child in self._children.pop(digest, ()):
            del self._parent[child]
            self._blocks.move_to_end(child, last=False)
        return block

    # ------------------------------------------------------------------ copies (device)

    def copy_into(self, cache: KVCache, placements: list[tuple[int, int, int]], pad_to: int = 0) -> None:
        """Pool block j into cache row r at block position i (slots i*block ..), for each (r, i, j).
        ``pad_to``: the most placements the caller's shape holds (see Static shapes)."""
        if not placements:
            return
        if self._by_slices:
            for mine, pool in ((cache.keys, self.keys), (cache.values, self.values)):
                for row, i, j, slots in self._spans(cache, placements):
                    mine[:, row, :, slots].copy_(self._block_view(pool)[:, j, :, : slots.stop - slots.start])
            return
        take, put = self._indices(cache, placements, pad_to)
        if self.per_layer:
            for mine, pool in zip(cache.flat_keys + cache.flat_values, self.keys + self.values):
                mine.index_copy_(0, put, pool.index_select(0, take))
            return
        for mine, pool in ((cache.keys, self.keys), (cache.values, self.values)):
            flat = mine.view(mine.shape[0], -1, mine.shape[-1])  # [L, B*H*K, D], the same storage
            flat.index_copy_(1, put, pool.index_select(1, take))

    def store(self, cache: KVCache, row: int, ids: list[int], upto: int, namespace: str = "",
              pad_to: int = 0, tail: bool = False) -> int:
        """Keep the whole blocks of ``ids[:upto]`` whose keys and values cache row ``row`` holds in
        slots 0..upto-1 and the pool does not hold yet, and with ``tail`` its last partial block
        (see Tails). Returns how many blocks were stored.
        ``pad_to``: the most blocks of a row the caller's shape holds (see Static shapes)."""
        placements = self.plan_store(ids, upto, namespace, tail_span=self.partial_span(cache) if tail else 0)
        self.write(cache, [(row, i, block) for i, block in placements], pad_to)
        return len(placements)

    def partial_span(self, cache: KVCache) -> int:
        """Slots of a ``cache`` row a partial block may take (its whole block, the slots past the
        row clamped: ``_indices``), or 0 where copies keep fixed shapes: on a Gaudi lookups and
        stores keep to whole blocks (see Partial blocks)."""
        return 0 if self.fixed_copy_shapes else -(-cache.length // self.block) * self.block

    def plan_store(self, ids: list[int], upto: int, namespace: str = "",
                   tail_span: int = 0) -> list[tuple[int, int]]:
        """The index's half of ``store``: the blocks of ``ids[:upto]`` the pool lacks get a place
        (evicting if need be), as (block position i, pool block) to be written by ``write``. What a
        tensor-parallel server's rank 0 decides and sends to the ranks. ``tail_span``: the slots of
        the row written from, where its tail is kept too (0: whole blocks only)."""
        placements, protected, chain = [], set(), []
        root = self._root(namespace)
        for i, digest in enumerate(self.digests(ids, namespace, upto)):
            known = self._blocks.get(digest)
            if known is None:
                known = self._claim(protected)
                if known is None:  # the pool is smaller than this prefix: keep what fits
                    break
                self._blocks[digest] = known
                self._tokens[digest] = tuple(ids[i * self.block:(i + 1) * self.block])
                placements.append((i, known))
            self._link(digest, chain[-1] if chain else root)  # (again, where the parent was evicted and is stored anew)
            protected.add(known)
            chain.append(digest)
        whole = len(chain) * self.block
        if tail_span and len(chain) == upto // self.block and whole < upto and whole + self.block <= tail_span:
            placed = self._plan_tail(tuple(ids[whole:upto]), chain[-1] if chain else root, protected)
            if placed is not None:
                digest, block, new = placed
                chain.append(digest)
                if new:
                    placements.append((len(chain) - 1, block))
        self._touch(chain)  # the deepest block the least recent, the trunk the most
        self.stats.stored_blocks += len(placements)
        return placements

    def _plan_tail(self, tokens: tuple[int, ...], prefix: bytes,
                   protected: set[int]) -> tuple[bytes, int, bool] | None:
        """A place for the tail ``tokens`` under ``prefix``: (its digest, its block, whether it must
        be written), or None where the pool has no block to spare. A held block under ``prefix``
        that starts with ``tokens`` serves; held tails that ``tokens`` extends are replaced."""
        under = self._children.get(prefix, set())
        for digest in under:
            if self._tokens[digest][:len(tokens)] == tokens:
                return digest, self._blocks[digest], False
        for digest in [d for d in under if len(self._tokens[d]) < len(tokens)
                       and tokens[:len(self._tokens[d])] == self._tokens[d]]:
            self._free.append(self._forget(digest))
        block = self._claim(protected)
        if block is None:
            return None
        digest = hashlib.blake2b(prefix + b"tail" + b"".join(t.to_bytes(4, "little") for t in tokens),
                                 digest_size=16).digest()
        self._blocks[digest] = block
        self._tokens[digest] = tokens
        self._link(digest, prefix)
        return digest, block, True

    def _link(self, digest: bytes, parent: bytes) -> None:
        self._parent[digest] = parent
        self._children.setdefault(parent, set()).add(digest)

    def write(self, cache: KVCache, placements: list[tuple[int, int, int]], pad_to: int = 0) -> None:
        """The device's half of ``store``: cache row r's block position i into pool block j, for
        each (r, i, j)."""
        if not placements:
            return
        if self._by_slices:
            for mine, pool in ((cache.keys, self.keys), (cache.values, self.values)):
                for row, i, j, slots in self._spans(cache, placements):
                    self._block_view(pool)[:, j, :, : slots.stop - slots.start].copy_(mine[:, row, :, slots])
            return
        take, put = self._indices(cache, placements, pad_to)  # (pool, cache) roles swapped below
        if self.per_layer:
            for mine, pool in zip(cache.flat_keys + cache.flat_values, self.keys + self.values):
                pool.index_copy_(0, take, mine.index_select(0, put))
        else:
            for mine, pool in ((cache.keys, self.keys), (cache.values, self.values)):
                pool.index_copy_(1, take, mine.view(mine.shape[0], -1, mine.shape[-1]).index_select(1, put))

    @property
    def _by_slices(self) -> bool:
        """Copy block by block, as slices of the stacked layout, on a CPU: there a gather of D-wide
        rows is several times slower than copying each block's [L, H, block, D] span, and no
        captured graph holds the cache."""
        return self.device.type == "cpu" and not self.per_layer

    def _block_view(self, pool: torch.Tensor) -> torch.Tensor:
        """The stacked pool [L, blocks*H*block, D] as [L, blocks, H, block, D] (the same storage)."""
        return pool.view(pool.shape[0], self.capacity, self.heads, self.block, pool.shape[-1])

    def _spans(self, cache: KVCache, placements: list[tuple[int, int, int]]):
        """(row, i, j, slots) of each placement: its slots cut at the row's end (a tail's block)."""
        for row, i, j in placements:
            start = i * self.block
            yield row, i, j, slice(start, min(start + self.block, cache.length))

    def _indices(self, cache: KVCache, placements: list[tuple[int, int, int]],
                 pad_to: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat pool rows and flat cache rows of each placement's [H, block] slots."""
        if self.fixed_copy_shapes:  # ``pad_to`` placements (else a power of two), the last one repeated
            count = max(pad_to, len(placements)) if pad_to else 1 << (len(placements) - 1).bit_length()
            placements = placements + [placements[-1]] * (count - len(placements))
        rows, positions, blocks = (torch.tensor(column, dtype=torch.long) for column in zip(*placements))
        heads = torch.arange(self.heads)[None, :, None]
        slots = torch.arange(self.block)[None, None, :]
        length = cache.length
        # A tail's block may reach past the row's last slot: those slots are clamped to it. Reading,
        # they fill slots past the tail's tokens (never used); writing, they land at or after the
        # first slot the prefill computes (``prefixed.py``), which it or the decode writes again
        # before anything attends it.
        offsets = (positions[:, None, None] * self.block + slots).clamp(max=length - 1)
        put = (rows[:, None, None] * self.heads + heads) * length + offsets
        take = (blocks[:, None, None] * self.heads + heads) * self.block + slots
        device = cache.slots.device
        return host_to_device(take.reshape(-1), device), host_to_device(put.reshape(-1), device)
