"""A Generator over random weights drawn in memory, on each rank, with no weight files.

The values follow the recipe of ``utils/random_checkpoint.py`` (its ``recipe_std`` and
``finish_recipe``), so the logits are peaky like a trained model's and greedy text varies with the
prompt. ``RandomReader`` stands where the checkpoint reader stands in ``bloom_hpu.loading.load_model``,
so the model is built, sharded and quantized by the same code as a real checkpoint.

Drawing billions of normal numbers is what made a start-up slow (about 10^8 a second a core: 17 s
of one core for the bloom-1b7 shape), so one pool of normal numbers is drawn once and every tensor
is cut from it: each block of rows is a window of the pool at an offset of its own, times a random
sign per column and the recipe's std, written straight in the loaded dtype (one pass over the
memory, no float32 copy of the model; what remains is mostly the kernel mapping the model's pages). Why that is still a valid random model of the recipe:

* within a block every value is a different pool value, and the pool's values are independent
  N(0, 1): the block is exactly an i.i.d. N(0, std^2) matrix, as the recipe draws it;
* blocks (of one tensor or of two) reuse pool values, but at unrelated offsets; the one alignment
  that could matter, two windows whose offsets differ by a multiple of the row length, would give
  two rows equal (two tokens with the same embedding: tied logits; two neurons computing the same
  thing). The per-column signs, drawn for each block, make such rows differ in about half of their
  signs, so they are as uncorrelated as two independent rows (their dot product is a sum of terms
  of random sign); the test checks that no two embeddings are near-parallel even from a tiny pool;
* the fixed parts (padded vocabulary rows zero, LayerNorm weights around 1 or -1) are the recipe's.

Each block's offset and signs come from a generator seeded by (seed, name, block): a rank cuts only
the blocks of the rows it holds, and every tensor-parallel size sees the same weights.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import torch

from bloom_hpu.checkpoint import expected_names
from bloom_hpu.config import BloomConfig
from utils.random_checkpoint import DEFAULT_WEIGHT_SCALE, finish_recipe, recipe_std, tensor_shape

BLOCK_ELEMENTS = 1 << 22  # elements per block of rows: 16 MB of fp32
POOL_ELEMENTS = 1 << 24  # the pool: 64 MB of fp32, drawn in about 0.1 s; a block is at most a quarter


class RandomReader:
    """The methods of ``bloom_hpu.checkpoint.CheckpointReader`` that loading uses, over random weights."""

    def __init__(self, config: BloomConfig, *, live_vocab: int, seed: int = 0,
                 weight_scale: float = DEFAULT_WEIGHT_SCALE, device: str = "cpu",
                 pool_elements: int = POOL_ELEMENTS):
        """``device``: where to draw (a CUDA card draws its weights itself: copying gigabytes from
        the host would take longer than drawing them; its generator gives other numbers than the CPU's).
        ``pool_elements``: the pool's size (tests make it tiny, to make blocks overlap)."""
        self.config = config
        self.device = torch.device(device)
        self.live_vocab = live_vocab
        self.seed = seed
        self.weight_scale = weight_scale
        self.pool_elements = pool_elements
        self.bytes_read = 0  # float32 bytes of the slices returned (the loader's report)

    def __enter__(self) -> RandomReader:
        # Every block must fit in the pool (``pool_elements`` may be smaller than the largest).
        size = max([self.pool_elements] + [self._block_rows(name) * self._row_len(name)
                                           for name in expected_names(self.config)])
        self._pools = {torch.float32: torch.randn(size, generator=self._generator("pool"), device=self.device)}
        return self

    def __exit__(self, *exc) -> None:
        self._pools.clear()

    def _pool(self, dtype: torch.dtype) -> torch.Tensor:
        """The pool in ``dtype``: cast once, so each block is one same-dtype multiply (a mixed one
        goes through a float32 temporary, twice the passes over memory)."""
        if dtype not in self._pools:
            self._pools[dtype] = self._pools[torch.float32].to(dtype)
        return self._pools[dtype]

    def shape(self, name: str) -> tuple[int, ...]:
        return tensor_shape(name, self.config)

    def stored_dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def _row_len(self, name: str) -> int:
        shape = self.shape(name)
        return 1 if len(shape) == 1 else shape[1]

    def _block_rows(self, name: str) -> int:
        """Rows of every block of ``name`` but its last."""
        return min(max(1, BLOCK_ELEMENTS // self._row_len(name)), self.shape(name)[0])

    def _generator(self, label: str) -> torch.Generator:
        # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
        return torch.Generator(self.device).manual_seed(zlib.crc32(f"{self.seed}/{label}".encode()))

    def _block(self, name: str, index: int, n_rows: int, row_len: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Block ``index`` of ``name`` as (its window of the pool [n_rows, row_len], the scale of
        each column [row_len]: the recipe's std with a random sign), in ``dtype``."""
        gen = self._generator(f"{name}#{index}")
        pool = self._pool(dtype)
        n = n_rows * row_len
        offset = int(torch.randint(0, pool.numel() - n + 1, (), generator=gen, device=self.device))
        signs = torch.randint(0, 2, (row_len,), generator=gen, device=self.device, dtype=torch.float32)
        scale = signs.mul_(2).sub_(1).mul_(recipe_std(name, self.config, self.weight_scale))
        return pool[offset : offset + n].view(n_rows, row_len), scale.to(dtype)

    def get(self, name: str, dtype: torch.dtype | None = None, rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor:
        shape = self.shape(name)
        n_rows, row_len, per_block = shape[0], self._row_len(name), self._block_rows(name)
        start, stop, _ = (0, n_rows, 1) if rows is None else rows.indices(n_rows)
        cols = slice(None) if cols is None else cols
        width = len(range(*cols.indices(row_len)))
        dtype = dtype or torch.float32
        out = torch.empty(stop - start, width, dtype=dtype, device=self.device)
        for i in range(start // per_block, (stop - 1) // per_block + 1):
            first, last = max(start, i * per_block), min(stop, (i + 1) * per_block)
            window, scale = self._block(name, i, min(per_block, n_rows - i * per_block), row_len, dtype)
            keep = slice(first - i * per_block, last - i * per_block)
            # One pass over the rank's memory: the window scaled and signed into its rows.
            torch.mul(window[keep, cols], scale[cols], out=out[first - start : last - start])
        finish_recipe(name, out, live_vocab=self.live_vocab, start=start)
        self.bytes_read += out.numel() * 4
        return out if len(shape) > 1 else out.view(-1)


def write_model_folder(folder: Path, config: BloomConfig, tokenizer_dir: str | None) -> int:
    """config.json and the tokenizer (a checkpoint's, or the test checkpoints' of 1000 tokens) into
    ``folder``: what the loader and the tokenizer read besides the weights. Returns the tokenizer's
    vocabulary size (the rows past it are padding, zero in the recipe)."""
    from utils.random_checkpoint import copy_tokenizer, write_test_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config.save(folder)
    if tokenizer_dir:
        copy_tokenizer(Path(tokenizer_dir), folder)
    else:
        write_test_tokenizer(folder)
    return tokenizer_size(folder)


def tokenizer_size(folder: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def build_generator(folder: Path, *, dtype: torch.dtype, quantize: str | None, device: str | None,
                    parallel, seed: int = 0, prefix_cache: int | str | None = None):
    """A Generator as ``Generator.from_pretrained`` makes one, its weights drawn by ``RandomReader``
    (``folder``: config.json and the tokenizer only)."""
    from bloom_hpu.loading import load_model
    from bloom_hpu.quantize import quantize as quantize_weights
    from bloom_hpu.quantize import resolve_group_size
    from bloom_hpu.runtime.backends import make_backend
    from bloom_hpu.runtime.steps import StepRunner
    from generation.generator import Generator
    from generation.request.validate import load_tokenizer
    from generation.run.prefix_pool import enable_prefix_cache

    config = BloomConfig.from_json(folder / "config.json")
    backend = make_backend(device)
    if parallel.world_size > 1 and backend.device.type != "cpu" and backend.device.index is None:
        backend.device = torch.device(backend.device.type, parallel.local_rank)
    reader = RandomReader(config, live_vocab=tokenizer_size(folder), seed=seed,
                          device=backend.device if backend.device.type == "cuda" else "cpu")
    model, report = load_model(folder, dtype, backend.device, parallel, reader=reader)
    if quantize is not None:
        quantize_weights(model, quantize, resolve_group_size(quantize, None))
    generator = Generator(model, load_tokenizer(folder, model.config), StepRunner(model, backend), folder, report)
    enable_prefix_cache(generator, prefix_cache)
    return generator
