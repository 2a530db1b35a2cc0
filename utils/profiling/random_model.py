"""A Generator over random weights drawn in memory, on each rank, with no weight files.

The values follow the recipe of ``utils/random_checkpoint.py`` (``random_tensor``), so the logits
are peaky like a trained model's and greedy text varies with the prompt. ``RandomReader`` stands
where the checkpoint reader stands in ``bloom_hpu.loading.load_model``, so the model is built,
sharded and quantized by the same code as a real checkpoint.

Each tensor is drawn in blocks of rows, each block from a generator seeded by (seed, name, block):
a rank draws only the blocks of the rows it holds, the blocks are drawn on as many threads as
torch has (one generator draws on one core), and every tensor-parallel size sees the same weights.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bloom_hpu.config import BloomConfig
from utils.random_checkpoint import DEFAULT_WEIGHT_SCALE, random_tensor, tensor_shape

BLOCK_ELEMENTS = 1 << 22  # elements per drawn block: 16 MB of fp32, enough to keep the threads busy


class RandomReader:
    """The methods of ``bloom_hpu.checkpoint.CheckpointReader`` that loading uses, over random weights."""

    def __init__(self, config: BloomConfig, *, live_vocab: int, seed: int = 0,
                 weight_scale: float = DEFAULT_WEIGHT_SCALE, threads: int | None = None, device: str = "cpu"):
        """``device``: where to draw (a CUDA card draws its weights itself: copying gigabytes from
        the host would take longer than drawing them; its generator gives other numbers than the CPU's)."""
        self.config = config
        self.device = torch.device(device)
        self.live_vocab = live_vocab
        self.seed = seed
        self.weight_scale = weight_scale
        self.threads = threads or torch.get_num_threads()
        self.bytes_read = 0  # float32 bytes drawn for the slices returned (the loader's report)

    def __enter__(self) -> RandomReader:
        self._pool = ThreadPoolExecutor(self.threads)
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown()

    def shape(self, name: str) -> tuple[int, ...]:
        return tensor_shape(name, self.config)

    def stored_dtype(self, name: str) -> torch.dtype:
        return torch.float32

    def _block(self, name: str, index: int, per_block: int, n_rows: int, keep: slice,
               cols: slice | None) -> torch.Tensor:
        """Block ``index`` of ``name`` (rows index * per_block ...), cut to its rows ``keep`` and ``cols``."""
        # 32 bits: the CPU generator (mt19937) keeps only the low 32 bits of a seed.
        gen = torch.Generator(self.device).manual_seed(zlib.crc32(f"{self.seed}/{name}#{index}".encode()))
        rows = slice(index * per_block, min((index + 1) * per_block, n_rows))
        block = random_tensor(name, self.config, live_vocab=self.live_vocab, weight_scale=self.weight_scale,
                              gen=gen, rows=rows)[keep]
        return block if cols is None else block[:, cols]

    def get(self, name: str, dtype: torch.dtype | None = None, rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor:
        shape = self.shape(name)
        n_rows = shape[0]
        row_len = 1 if len(shape) == 1 else shape[1]
        per_block = max(1, BLOCK_ELEMENTS // row_len)
        start, stop, _ = (0, n_rows, 1) if rows is None else rows.indices(n_rows)
        width = () if len(shape) == 1 else (len(range(*cols.indices(row_len))) if cols is not None else row_len,)
        out = torch.empty(stop - start, *width, dtype=dtype or torch.float32, device=self.device)

        def fill(i: int) -> None:
            # Each pool thread draws a block and casts it straight into its rows of ``out``.
            first = max(start, i * per_block)
            last = min(stop, (i + 1) * per_block)
            keep = slice(first - i * per_block, last - i * per_block)
            out[first - start : last - start] = self._block(name, i, per_block, n_rows, keep, cols)

        list(self._pool.map(fill, range(start // per_block, (stop - 1) // per_block + 1)))
        self.bytes_read += out.numel() * 4
        return out


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
                          threads=int(os.environ.get("OMP_NUM_THREADS") or 0) or None,
                          device=backend.device if backend.device.type == "cuda" else "cpu")
    model, report = load_model(folder, dtype, backend.device, parallel, reader=reader)
    if quantize is not None:
        quantize_weights(model, quantize, resolve_group_size(quantize, None))
    generator = Generator(model, load_tokenizer(folder, model.config), StepRunner(model, backend), folder, report)
    enable_prefix_cache(generator, prefix_cache)
    return generator
