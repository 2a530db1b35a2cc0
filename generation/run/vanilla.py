"""The vanilla path: transformers' ``BloomForCausalLM.generate`` on the same weights and options.

It is the baseline the optimized path is measured and checked against, and an escape hatch for
options we do not implement (typed ``--options`` keys pass straight through to ``generate``).
Prompts of a batch are left-padded, as transformers expects; each row is then cut to its own
``max_length`` budget so the results mean the same as the optimized path's.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from .batch import InputError
from ..request.options import GenerationOptions
from .results import BatchStats, GenerationResult, make_sequence


class VanillaGenerator:
    def __init__(self, folder: Path, dtype: torch.dtype, device: str):
        import transformers  # heavy; only this path needs it

        transformers.logging.set_verbosity_error()
        self.folder = Path(folder)
        self.device = torch.device(device)
        from ..request.validate import check_checkpoint, load_tokenizer

        check_checkpoint(folder)
        self.model = transformers.BloomForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(self.device).eval()
        self.tokenizer = load_tokenizer(folder, self.model.config)
        self.last_stats: BatchStats | None = None
        self.load_report = None  # transformers loads on its own; no sliced-read report

    def hf_kwargs(self, opts: GenerationOptions, shortest: int) -> dict:
        """transformers ``generate`` arguments equivalent to our options. Rows have their own budget
        (max_length - their length): generate for the largest, then cut each row to its own."""
        new_tokens = opts.max_length - shortest
        if opts.max_new_tokens is not None:
            new_tokens = min(new_tokens, opts.max_new_tokens)
        kwargs = dict(
            max_new_tokens=max(new_tokens, 1),
            min_new_tokens=opts.min_new_tokens or None,
            num_beams=opts.num_beams,
            do_sample=opts.do_sample,
            temperature=opts.temperature,
            top_k=opts.top_k,
            top_p=opts.top_p,
            repetition_penalty=opts.repetition_penalty,
            length_penalty=opts.length_penalty,
            no_repeat_ngram_size=opts.no_repeat_ngram_size,
            early_stopping=opts.early_stopping,
            num_return_sequences=opts.num_return_sequences,
            use_cache=opts.use_kv_cache,
            pad_token_id=self.tokenizer.pad_token_id,
            # ignore_eos: no EOS stops a row; we still cut the returned text at EOS afterwards.
            eos_token_id=None if opts.ignore_eos else self.tokenizer.eos_token_id,
        )
        kwargs.update(opts.extra)
        return kwargs

    def check_fits(self, prompts: list[str], opts: GenerationOptions) -> None:
        """As ``Generator.check_fits``: transformers grows its cache to max_length, so a huge
        max_length would run for ever or take all the memory; refuse it first."""
        from ..request.validate import check_against_model, check_memory, rows_per_prompt

        check_against_model(opts, self.model.config.vocab_size)
        longest = max(len(ids) for ids in self.tokenizer.encode_batch(prompts)) if prompts else 1
        check_memory(self.model.config, self.model.dtype, self.device, len(prompts) * rows_per_prompt(opts),
                     opts.max_length, min(longest, opts.max_length))

    @torch.no_grad()
    def generate(self, prompts: str | list[str], opts: GenerationOptions, progress: bool = False) -> list[GenerationResult]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise InputError("no prompts to generate from")
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(opts, name, None) is not None]
        if asked:  # transformers' generate here has no grammar: refused, not silently ignored
            raise InputError(f"{asked[0]} (structured output) runs in --mode optimized only")
        self.check_fits(prompts, opts)
        start = time.perf_counter()
        ids = self.tokenizer.encode_batch(prompts)
        for i, row in enumerate(ids):
            if not row or len(row) >= opts.max_length:
                raise InputError(f"prompt {i + 1} has {len(row)} tokens; it must have 1..{opts.max_length - 1} "
                                 f"to leave room under max_length={opts.max_length}")
        longest = max(len(r) for r in ids)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor([[pad] * (longest - len(r)) + r for r in ids], device=self.device)
        attention_mask = (torch.arange(longest, device=self.device)[None] >= torch.tensor(
            [longest - len(r) for r in ids], device=self.device)[:, None]).long()
        if opts.seed is not None:
            torch.manual_seed(opts.seed)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, **self.hf_kwargs(opts, min(len(r) for r in ids))
        )
        generated = out[:, longest:].tolist()
        per_prompt = len(generated) // len(prompts)
        results = []
        for i, (prompt, row_ids) in enumerate(zip(prompts, ids)):
            budget = opts.max_length - len(row_ids)
            if opts.max_new_tokens is not None:
                budget = min(budget, opts.max_new_tokens)
            sequences = []
            for seq in generated[i * per_prompt : (i + 1) * per_prompt]:
                sequences.append(make_sequence(self.tokenizer, seq[:budget], "length"))
            results.append(GenerationResult(prompt, row_ids, sequences))
        self.last_stats = BatchStats(
            time.perf_counter() - start, sum(len(s.token_ids) for r in results for s in r.sequences), 0
        )
        return results
