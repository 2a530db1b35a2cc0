"""The public entry point: ``Generator.from_pretrained(path).generate(prompts, ...)``.

It loads a checkpoint into the static-shape model, picks a backend, turns prompts into a padded
``Batch``, runs the chosen search on the device, and turns the tokens back into results.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from bloom_hpu.backends import make_backend
from bloom_hpu.checkpoint import resolve_checkpoint
from bloom_hpu.loading import LoadReport, load_model
from bloom_hpu.parallel import Parallel, SINGLE
from bloom_hpu.steps import StepRunner

from .batch import Batch, BloomTokenizer, make_batch
from .options import GenerationOptions, build_options
from .results import BatchStats, GenerationResult, Sequence
from .token_loop import FINISH_REASONS, greedy_chooser, run_token_loop

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Generator:
    """Generates text with a static-shape BLOOM on cpu, cuda or hpu."""

    def __init__(self, model, tokenizer: BloomTokenizer, runner: StepRunner, folder: Path, load_report=None):
        self.model = model
        self.tokenizer = tokenizer
        self.runner = runner
        self.folder = folder
        self.load_report: LoadReport | None = load_report
        self.last_stats: BatchStats | None = None

    @classmethod
    def from_pretrained(
        cls,
        weights: str | Path | None,
        model: str | None = None,
        *,
        dtype: str | torch.dtype = "fp32",
        device: str | None = None,
        use_graphs: bool = True,
        compile_steps: bool = False,
        parallel: Parallel = SINGLE,
    ) -> "Generator":
        folder = resolve_checkpoint(str(weights) if weights is not None else None, model)
        backend = make_backend(device, use_graphs=use_graphs, compile_steps=compile_steps)
        if parallel.world_size > 1 and backend.device.type != "cpu" and backend.device.index is None:
            backend.device = torch.device(backend.device.type, parallel.local_rank)
        bloom, report = load_model(folder, parse_dtype(dtype), backend.device, parallel)
        config = bloom.config
        tokenizer = BloomTokenizer(folder, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
        return cls(bloom, tokenizer, StepRunner(bloom, backend), folder, report)

    @property
    def backend(self):
        return self.runner.backend

    @property
    def device(self) -> torch.device:
        return self.runner.backend.device

    def options(self, options: GenerationOptions | str | None = None, **kwargs) -> GenerationOptions:
        """Resolve options from a GenerationOptions, an ``--options`` string, and keywords."""
        if isinstance(options, GenerationOptions):
            return options.updated(**kwargs) if kwargs else options.validate()
        return build_options(options or "", **kwargs)

    def generate(self, prompts: str | list[str], options: GenerationOptions | str | None = None, **kwargs):
        """Continue each prompt; returns one ``GenerationResult`` per prompt, in order.

        Keyword arguments are generation options (see ``generation.options.OPTIONS``), e.g.
        ``generate(["Hello"], max_length=32, ignore_eos=False)``. All prompts run as one batch.
        """
        opts = self.options(options, **kwargs)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        start = time.perf_counter()
        batch = make_batch(self.tokenizer, prompts, opts, self.device)
        sequences = self._search(batch, opts)
        self.backend.synchronize()
        results = [
            GenerationResult(prompt, ids, seqs) for prompt, ids, seqs in zip(prompts, batch.prompt_ids, sequences)
        ]
        new_tokens = sum(len(s.token_ids) for r in results for s in r.sequences)
        self.last_stats = BatchStats(time.perf_counter() - start, new_tokens, self.backend.graph_count())
        return results

    def _search(self, batch: Batch, opts: GenerationOptions) -> list[list[Sequence]]:
        """Run the search the options ask for; one list of sequences per prompt."""
        loop = run_token_loop(
            self.runner,
            batch,
            greedy_chooser,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            ignore_eos=opts.ignore_eos,
            use_kv_cache=opts.use_kv_cache,
        )
        tokens, finish = loop.tokens.tolist(), loop.finish.tolist()
        limits = batch.new_limits.tolist()
        return [[self.make_sequence(row[:limit], FINISH_REASONS[reason])]
                for row, limit, reason in zip(tokens, limits, finish)]

    def make_sequence(self, ids: list[int], finish_reason: str, score: float | None = None) -> Sequence:
        """Cut generated ids at the first EOS (kept in ids, not in text) and detokenize."""
        eos = self.tokenizer.eos_token_id
        if eos in ids:
            ids = ids[: ids.index(eos) + 1]
            finish_reason = "eos"
        return Sequence(self.tokenizer.decode(ids), ids, finish_reason, score)
