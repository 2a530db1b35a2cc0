"""The public entry point: ``Generator.from_pretrained(path).generate(prompts, ...)``.

It loads a checkpoint into the static-shape model, picks a backend, turns prompts into a padded
``Batch``, runs the chosen search on the device, and turns the tokens back into results.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path

import torch

from bloom_hpu.runtime.backends import make_backend
from bloom_hpu.runtime.cpu import CpuOptions
from bloom_hpu.checkpoint import resolve_checkpoint
from bloom_hpu.config import BloomConfig
from bloom_hpu.loading import LoadReport, load_model
from bloom_hpu.lora import read_adapter
from bloom_hpu.lora_rows import ServedAdapters, stack
from bloom_hpu.int8_activations import NEEDS_QUANTIZED, Int8ActivationsError
from bloom_hpu.int8_activations import parse_mode as parse_int8_activations
from bloom_hpu.quantize import (MODES as QUANTIZE_MODES, QuantizeError, resolve_group_size, stored_quantization,
                                use_int8_activations)
from bloom_hpu.quantize import quantize as quantize_weights
from bloom_hpu.tp import Parallel, SINGLE
from bloom_hpu.runtime.steps import StepRunner

from .run.batch import Batch, BloomTokenizer, InputError, encode_prompts, make_batch  # noqa: F401 (BloomTokenizer: re-exported)
from .request.options import GenerationOptions, OptionError, build_options
from .run.prefix_pool import cached_counts, enable_prefix_cache, parse_size, store_generated
from .run.progress import Progress
from .run.results import BatchStats, GenerationResult, Sequence, make_sequence
from .search.beam import beam_search
from .search.choose import GrammarSteps, chooser
from .search.processors import LogitsProcessors
from .search.draft import DraftModel, check_draft, check_draft_fits
from .search.guesses import Speculation, SpeculationError, parse_speculation, worth_verifying
from .search.sampling import UniformKernel, checked_uniform_kernel, repeat_rows, row_keys, sampling_seeds
from .search.stopping import StopChecker, stops_per_prompt
from .search.speculation import SpeculationStats, run_speculative_loop
from .search.token_loop import FINISH_REASONS, LoopHooks, run_token_loop
from .request.grammar import FIELDS as GRAMMAR_FIELDS, Grammar, GrammarRows, for_tokenizer, grammar_from_fields
from .request.grammar import options_grammar
from .request.validate import (check_against_model, check_call, check_checkpoint, check_dtype, check_memory,
                       load_tokenizer, rows_per_prompt)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PROGRESS_DELAY = 3.0  # seconds before a generate call shows its progress bar (a short call shows none)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    check_dtype(dtype)
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
        self.adapter = None  # the LoRA adapter merged at load, if any
        self.lora: ServedAdapters | None = None  # adapters served unmerged, row by row
        self.speculation: Speculation | None = None  # guesses verified several a pass (search/speculation.py)
        self._speculated: SpeculationStats | None = None  # what the last call's speculation did
        self.draft: DraftModel | None = None  # speculation's draft model (search/draft.py), when one is loaded

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
        cpu: CpuOptions = CpuOptions(),
        peft_weights: str | Path | None = None,
        lora: dict[str, str | Path] | None = None,
        limit_hpu_graphs: bool | None = None,
        quantize: str | None = None,
        group_size: int | None = None,
        int8_activations: bool | str = "auto",
        prefix_cache: int | str | None = None,
        speculate: str | None = None,
        draft_model: str | Path | None = None,
    ) -> "Generator":
        """``cpu``: the CPU fast path (``CpuOptions``: which kernels, one-call steps, packing);
        by default the fastest this CPU can run. ``peft_weights``: a PEFT LoRA adapter folder,
        merged into the weights at load (``bloom_hpu/lora.py``). ``lora``: {name: folder} of
        adapters served side by side, unmerged, each row of a step with its own
        (``bloom_hpu/lora_rows.py``; ``self.lora`` then holds them, for the server's engine).
        ``limit_hpu_graphs``: on a Gaudi, run the prefill without a graph (Habana's
        ``--limit_hpu_graphs``; None: only under tensor parallelism). ``quantize``: "int8", the
        weights kept as int8 with a scale per output row, or "int4", packed with a scale per
        ``group_size`` weights of a row (default 64; ``bloom_hpu/quantize.py``; activations and the
        cache stay in ``dtype``). A checkpoint saved quantized loads as it is stored.
        ``int8_activations``: with quantized weights, "on" (or True): integer products, the input of
        every quantized product rounded to int8 per block of 32 values (``bloom_hpu/int8_activations.py``),
        which a CPU multiplies by the weight in integer arithmetic; "off" (or False): the products are
        of the dequantized weight with the activations as they are; "auto" (default): on the CPU,
        whichever its runtime measured faster, for prompts and decode rows apart (``cpu.int8_activations``),
        on a card off.
        ``prefix_cache``: the size of the prefix cache's pool (bytes, or a string such as "1GB";
        None or 0: none): the keys and values of prompt prefixes seen before are copied instead
        of computed (``generation/run/prefix_pool.py``).
        ``speculate``: "ngram" or "ngram:K": greedy search and sampling verify up to K guesses of
        each row (prompt lookup) in one pass, the same tokens (``generation/search/speculation.py``);
        "draft" or "draft:K" with ``draft_model``: the guesses of a smaller BLOOM with the same
        tokenizer (a checkpoint folder), loaded beside the target with the same options
        (``generation/search/draft.py``)."""
        speculation = parse_speculation(speculate)  # named before anything is loaded
        drafting = speculation is not None and speculation.kind == "draft"
        if drafting and draft_model is None:
            raise SpeculationError(f"speculate={str(speculation)!r} needs a draft model: draft_model=DIR "
                                   "(--draft_model DIR), a smaller BLOOM with the same tokenizer")
        if draft_model is not None and not drafting:
            raise SpeculationError("draft_model goes with speculate='draft[:K]' (--speculate draft[:K])")
        prefix_bytes = parse_size(prefix_cache)  # a bad size is named before anything is loaded
        if quantize is not None and quantize not in QUANTIZE_MODES:
            raise QuantizeError(f"unknown quantization {quantize!r}: choose {', '.join(QUANTIZE_MODES)}")
        group_size = resolve_group_size(quantize, group_size)
        if weights is not None and not isinstance(weights, (str, Path)):
            raise TypeError(f"weights must be a folder path, got {type(weights).__name__}")
        torch_dtype = parse_dtype(dtype)
        folder = resolve_checkpoint(str(weights) if weights is not None else None, model)
        check_checkpoint(folder)  # a broken config.json is named before any tensor is read
        config = BloomConfig.from_json(folder / "config.json")
        # The draft's config and tokenizer against the target's, before either is loaded.
        draft_folder, draft_config = check_draft(draft_model, folder, config) if drafting else (None, None)
        stored = stored_quantization(config)
        if quantize is not None and stored is not None and (quantize, group_size) != stored:
            saved = stored[0] + (f" with groups of {stored[1]}" if stored[1] else "")
            raise QuantizeError(f"the checkpoint is stored {saved}; it cannot be quantized again as {quantize}"
                                f"{f' with groups of {group_size}' if group_size else ''} (leave out --quantize, "
                                "or give the float checkpoint)")
        int8_activations = parse_int8_activations(int8_activations)
        if int8_activations == "on" and quantize is None and stored is None:
            raise Int8ActivationsError(NEEDS_QUANTIZED)
        if int8_activations != "auto":  # the runtime's choice follows the argument
            cpu = replace(cpu, int8_activations=int8_activations)
        adapter, served = None, {}
        if peft_weights is not None or lora:  # checked against the config before the model is read
            adapter = read_adapter(peft_weights, config) if peft_weights is not None else None
            served = {name: read_adapter(path, config) for name, path in (lora or {}).items()}
        backend = make_backend(device, use_graphs=use_graphs, compile_steps=compile_steps, cpu=cpu,
                               graph_prefill=None if limit_hpu_graphs is None else not limit_hpu_graphs)
        if parallel.world_size > 1 and backend.device.type != "cpu" and backend.device.index is None:
            backend.device = torch.device(backend.device.type, parallel.local_rank)
        bloom, report = load_model(folder, torch_dtype, backend.device, parallel, adapter)
        if quantize is not None and stored is None:
            quantize_weights(bloom, quantize, group_size)  # before the runtime sees the model: its fast path keeps them
        if int8_activations == "on":
            use_int8_activations(bloom)  # before the runtime: it gives these products its integer kernel
        tokenizer = load_tokenizer(folder, bloom.config)
        generator = cls(bloom, tokenizer, StepRunner(bloom, backend), folder, report)
        generator.adapter = adapter
        if served:
            rows = stack(list(served.values()), bloom)
            names = {name: k for k, name in enumerate(served, start=1)}
            generator.lora = ServedAdapters(names, {n: a.folder for n, a in served.items()}, rows)
            if backend.cpu_plan is not None:  # its one-call decode step knows no adapters
                backend.cpu_plan.drop_one_call_decode("LoRA adapters are served")
        enable_prefix_cache(generator, prefix_bytes)
        generator.speculation = speculation
        if drafting:  # loaded like the target, with its options (no adapters, no prefix cache)
            check_draft_fits(draft_folder, draft_config, torch_dtype, backend.device, parallel)
            draft = cls.from_pretrained(draft_folder, dtype=dtype, device=device, use_graphs=use_graphs,
                                        compile_steps=compile_steps, parallel=parallel, cpu=cpu,
                                        limit_hpu_graphs=limit_hpu_graphs, quantize=quantize, group_size=group_size,
                                        int8_activations=int8_activations)
            generator.draft = DraftModel(draft.runner, draft_folder)
        return generator

    @property
    def dtype(self) -> torch.dtype:
        return self.model.ln_f.weight.dtype

    @property
    def backend(self):
        return self.runner.backend

    @property
    def device(self) -> torch.device:
        return self.runner.backend.device

    @functools.cached_property
    def noise_kernel(self) -> UniformKernel | None:
        """The CPU kernels' sampling noise where this generator's runtime loaded them (the same
        bits as ``sampling.uniform``, checked once; one pass over the [rows, vocabulary] noise where
        PyTorch's operations make several), else None: on a card the noise stays PyTorch's operations."""
        plan = self.backend.cpu_plan
        if plan is None or plan.kernels is None:
            return None
        return checked_uniform_kernel(plan.kernels.counter_uniform)

    def options(self, options: GenerationOptions | str | None = None, **kwargs) -> GenerationOptions:
        """Resolve options from a GenerationOptions, an ``--options`` string, and keywords."""
        if isinstance(options, GenerationOptions):
            return options.updated(**kwargs) if kwargs else options.validate()
        return build_options(options or "", **kwargs)

    def generate(self, prompts: str | list[str | list[int]], options: GenerationOptions | str | None = None, *,
                 stop=None, logprobs: bool = False, on_step=None, max_new_tokens_each: list[int] | None = None,
                 seed_each: list[int | None] | None = None, progress: bool = False,
                 grammar_each: list[Grammar | None] | None = None, speculate: str | None = None, **kwargs):
        """Continue each prompt; returns one ``GenerationResult`` per prompt, in order.

        Keyword arguments are generation options (see ``generation.request.options.OPTIONS``), e.g.
        ``generate(["Hello"], max_length=32, ignore_eos=False)``. All prompts run as one batch.
        A prompt is a string or a list of token ids (``generate([[52, 88, 392]])``).
        ``stop``: a string or list of strings (or one list per prompt) that ends a sequence; the
        text excludes it and the finish reason is "stop". ``logprobs``: fill each sequence's
        ``token_logprobs`` (the model's log-probabilities, see ``generation/run/logprobs.py``).
        ``on_step(tokens [B], done [B])``: called with device tensors after each token of greedy
        search or sampling (streaming, see ``generation/run/streaming.py``; speculating, the same
        calls, several after a pass that accepted guesses). ``progress``: steps done on
        stderr (``generation/run/progress.py``) once the call has taken a few seconds. ``max_new_tokens_each``: a
        budget of new tokens per prompt, under ``max_new_tokens`` (one batch for requests that want
        different lengths: each row stops at its own; the batch runs to the largest). ``seed_each``: a
        sampling seed per prompt (None: the options' seed), for one batch of requests with different
        seeds; each prompt samples what it samples alone with its own seed.
        Structured output (``docs/structured-output.md``): ``response_format``, ``guided_json``,
        ``guided_regex``, ``guided_choice`` or ``guided_grammar`` constrains every prompt's
        continuation (greedy or sampled; not beams); ``grammar_each``: one ``structured.Grammar``
        (or None) per prompt. ``speculate``: this call's speculation ("ngram:K", or "off"), in place
        of the generator's (``from_pretrained(speculate=...)``).
        """
        prompts = check_call(prompts, options, on_step, max_new_tokens_each, seed_each)
        grammar = grammar_from_fields(**{k: kwargs.pop(k) for k in GRAMMAR_FIELDS if k in kwargs})
        if grammar is not None:
            grammar_each = [grammar] * len(prompts)
        opts = self.options(options, **kwargs)
        speculation = self.speculation if speculate is None else parse_speculation(speculate)
        if speculation is not None and opts.num_beams > 1:
            raise SpeculationError(f"speculative decoding ({speculation}) works with greedy search and sampling, "
                                   "not with beam search (num_beams > 1)")
        if speculation is not None and speculation.kind == "draft" and self.draft is None:
            raise SpeculationError(f"speculate={str(speculation)!r} needs the draft model loaded with the generator: "
                                   "Generator.from_pretrained(..., speculate='draft', draft_model=DIR)")
        if grammar is None and grammar_each is None:
            grammar_each = options_grammar(opts, len(prompts))
        self.backend.check_static(opts.static_shapes)
        stops = stops_per_prompt(stop, len(prompts))
        self.check_fits(prompts, opts, speculation)
        start = time.perf_counter()
        batch = make_batch(self.tokenizer, prompts, opts, self.device, max_new_tokens_each)
        checker = StopChecker(self.tokenizer, stops) if any(stops) else None
        with Progress(batch.steps, "generating", "steps", enabled=progress, delay=PROGRESS_DELAY) as bar:
            hooks = LoopHooks(on_step=on_step, stop_check=checker, tick=(lambda: bar.update(1)) if progress else None)
            sequences = self._search(batch, opts, stops, hooks, seed_each, self.grammar_rows(grammar_each, opts),
                                     speculation)
        if logprobs:
            from .run.logprobs import fill_token_logprobs

            fill_token_logprobs(self, batch, sequences)
        self.backend.synchronize()
        cached = cached_counts(self, batch.size)
        results = [
            GenerationResult(prompt, ids, seqs, cached_tokens=n)
            for prompt, ids, seqs, n in zip(batch.prompts, batch.prompt_ids, sequences, cached)
        ]
        new_tokens = sum(len(s.token_ids) for r in results for s in r.sequences)
        self.last_stats = BatchStats(time.perf_counter() - start, new_tokens, self.backend.graph_count(),
                                     cached_tokens=sum(cached), speculation=self._speculated)
        return results

    def check_fits(self, prompts: list[str | list[int]], opts: GenerationOptions, speculation: Speculation | None = None) -> None:
        """Options against the vocabulary, and the call's memory against what is free, before
        anything is allocated (a max_length of a billion is refused here, not by the allocator).
        With a draft model, its cache of the call's shape counts too."""
        check_against_model(opts, self.model.config.vocab_size)
        if not prompts:
            return
        prompt_ids = encode_prompts(self.tokenizer, prompts)
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(prompt_ids):
            if max(ids) >= vocab:
                raise InputError(f"prompts[{i}]: token id {max(ids)} is outside the model's vocabulary (0..{vocab - 1})")
        longest = max(len(ids) for ids in prompt_ids)
        rows, prompt_len = len(prompts) * rows_per_prompt(opts), min(longest, opts.max_length)
        drafts = speculation is not None and speculation.kind == "draft" and self.draft is not None
        extra = self.draft.call_bytes(rows, opts.max_length, prompt_len) if drafts else 0
        check_memory(self.model.config, self.dtype, self.device, rows, opts.max_length, prompt_len,
                     self.model.parallel, extra=extra)

    def grammar_rows(self, grammar_each: list[Grammar | None] | None, opts: GenerationOptions) -> GrammarRows | None:
        """The matchers of the call's rows (a prompt's copies share its grammar), or None."""
        if not grammar_each or all(g is None for g in grammar_each):
            return None
        if opts.num_beams > 1:
            raise OptionError("structured output (response_format, guided_*) works with greedy search and sampling, "
                              "not with beam search (num_beams > 1)")
        compiler = for_tokenizer(self.tokenizer, self.model.config.vocab_size)
        copies = opts.num_return_sequences if opts.do_sample else 1
        rows = GrammarRows(len(grammar_each) * copies, self.model.config.vocab_size, self.device)
        for i, grammar in enumerate(grammar_each):
            for c in range(copies):
                if grammar is not None:
                    rows.set(i * copies + c, compiler.matcher(grammar))
        return rows

    def _search(self, batch: Batch, opts: GenerationOptions, stops: list[list[str]],
                hooks: LoopHooks, seed_each: list[int | None] | None = None,
                grammars: GrammarRows | None = None, speculation: Speculation | None = None) -> list[list[Sequence]]:
        """Run the search the options ask for (greedy, sampling, beam search or beam sampling);
        one list of sequences per prompt, each ended at its EOS or its prompt's stop strings."""
        eos = self.tokenizer.eos_token_id
        processors = LogitsProcessors.from_options(opts, eos)
        seed = sampling_seeds(opts.do_sample, opts.seed, seed_each)
        if opts.num_beams > 1:
            return self._beam_search(batch, opts, processors, seed, stops, hooks.tick)
        # Sampling draws num_return_sequences independent rows per prompt; greedy has one.
        copies = opts.num_return_sequences if opts.do_sample else 1
        rows = repeat_rows(batch, copies)
        keys = row_keys(batch.prompt_ids, seed, copies, self.device) if opts.do_sample else None
        steps = GrammarSteps(grammars) if grammars is not None else None
        if steps is not None:
            hooks = replace(hooks, grammar_ended=lambda: steps.ended)
        choose = chooser(processors, keys, self.noise_kernel, steps)
        self._speculated = None
        # Speculation serves every greedy and sampled call (streaming hooks and grammars too) but
        # the recompute switch (use_kv_cache=false), which has no cache to verify guesses over.
        # A greedy batch too large for a verify pass to pay (on the CPU: ``worth_verifying``) steps
        # aside, its tokens the same either way; a sampled one does not, so that a seeded row's
        # text never depends on how many rows share its batch.
        if speculation is not None and opts.use_kv_cache and not opts.do_sample and \
                not worth_verifying(rows.size, speculation.shape_k + 1, self.device):
            self._speculated = SpeculationStats(stepped_aside=1)
            speculation = None
        if speculation is not None and opts.use_kv_cache:
            loop, self._speculated = run_speculative_loop(
                self.runner, rows, processors, speculation, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id,
                ignore_eos=opts.ignore_eos, keys=keys, kernel=self.noise_kernel, hooks=hooks, grammars=grammars,
                guesser=self.draft.guesser() if speculation.kind == "draft" else None)
        else:
            loop = run_token_loop(self.runner, rows, choose, eos_token_id=eos, pad_token_id=self.tokenizer.pad_token_id,
                                  ignore_eos=opts.ignore_eos, use_kv_cache=opts.use_kv_cache, hooks=hooks)
        tokens, finish = loop.tokens.tolist(), loop.finish.tolist()
        # Each row's tokens: its budget, or where rows ran at their own pace, its count.
        limits = rows.new_limits.tolist() if loop.counts is None else loop.counts.tolist()
        if grammars is not None:
            # A row its grammar ended keeps what its grammar took (not the forced end). Not more
            # than its own tokens: the plain loop feeds a finished row's pads to its grammar while
            # other rows run, and a pad may "end" it.
            limits = [min(n, limit) if ended else limit
                      for n, ended, limit in zip(grammars.consumed, grammars.ended, limits)]
        flat = [self.make_sequence(row[:min(limit, loop.steps_run)], FINISH_REASONS[reason], stops=stops[i // copies])
                for i, (row, limit, reason) in enumerate(zip(tokens, limits, finish))]
        if opts.use_kv_cache:  # a conversation's next turn repeats these tokens
            store_generated(self, self.runner.cache(rows.size, rows.plan.cache_len), rows.prompt_ids,
                            [s.token_ids for s in flat])
        return [flat[i * copies : (i + 1) * copies] for i in range(batch.size)]

    def _beam_search(self, batch: Batch, opts: GenerationOptions, processors, seed,
                     stops: list[list[str]], tick=None) -> list[list[Sequence]]:
        eos = self.tokenizer.eos_token_id
        out = beam_search(
            self.runner,
            batch,
            processors,
            num_beams=opts.num_beams,
            length_penalty=opts.length_penalty,
            early_stopping=opts.early_stopping,
            eos_token_id=None if opts.ignore_eos else eos,
            pad_token_id=self.tokenizer.pad_token_id,
            use_kv_cache=opts.use_kv_cache,
            sample_keys=row_keys(batch.prompt_ids, seed, 1, self.device) if opts.do_sample else None,
            tick=tick,
            noise_kernel=self.noise_kernel,
        )
        n = opts.num_return_sequences
        # The one host copy of the search: the n best finished hypotheses of each prompt.
        rows, counts, scores = out.sequences[:, :n].tolist(), out.new_tokens[:, :n].tolist(), out.scores[:, :n].tolist()
        results = []
        for b, start in enumerate(batch.lengths.tolist()):
            seqs = []
            for ids, count, score in zip(rows[b], counts[b], scores[b]):
                # make_sequence turns an ending EOS or stop string into finish_reason "eos" or "stop".
                seqs.append(self.make_sequence(ids[start : start + count], "length", score, stops[b]))
            results.append(seqs)
        return results

    def stream(self, prompt: str, options: GenerationOptions | str | None = None, *, stop=None, on_result=None,
               **kwargs):
        """Iterate over text pieces of one prompt's continuation as they are generated; the pieces
        join to ``generate(prompt, ...)[0].text``. ``on_result(GenerationResult)`` is called with
        the finished result (to save it). See ``generation/run/streaming.py``."""
        from .run.streaming import stream_text

        if not isinstance(prompt, str):
            raise TypeError(f"stream takes one prompt (a string), got {type(prompt).__name__}")
        check_call(prompt, options, None, None)
        if on_result is not None and not callable(on_result):
            raise TypeError(f"on_result must be callable, got {type(on_result).__name__}")
        opts = self.options(options, **kwargs)
        self.check_fits([prompt], opts)  # raised here, at the call, not from the worker thread
        return stream_text(self, prompt, opts, stop=stop, on_result=on_result)

    def make_sequence(self, ids: list[int], finish_reason: str, score: float | None = None,
                      stops: list[str] = ()) -> Sequence:
        return make_sequence(self.tokenizer, ids, finish_reason, score, stops)
