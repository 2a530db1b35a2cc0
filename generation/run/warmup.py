"""Warm-up: run every step shape a serving process can meet, before the first request.

With static shapes a request's shapes follow from the options alone, and with buckets from the
bucket of its longest prompt, so the whole set is known up front: for each possible longest-prompt
length we ask ``plan_shapes`` (the very function requests use) for its plan and collect

* one prefill per (rows, padded prompt length P, cache length K) (for beams and sampled copies:
  per (prompts, P, P), the prompts run once each), and
* one decode per (rows, K, window) for every window its steps can use;
* with a prefix cache, one extend per (rows, K, rest bucket R) beside each prefill, and the one-row
  prefill and extends that compute a batch's shared prefixes (``runtime/prefixed.py``).

Running each once captures its graph (HPU/CUDA), compiles it (``torch.compile`` on CPU) and
allocates its cache, so no request ever pays a first-time compile. Its inputs are made exactly as
the search loops make theirs (``steps.step_input``: fresh, contiguous tensors), because HPU graphs
are keyed on strides, storage offsets and view-ness as well as shapes. Dynamic shapes
(``static_shapes=false`` without buckets) have a new shape at every length and are not warmed up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from bloom_hpu.runtime.prefixed import rest_buckets
from bloom_hpu.runtime.steps import step_input

from .batch import plan_shapes
from ..request.options import GenerationOptions
from .progress import Progress


@dataclass(frozen=True)
class StepShape:
    kind: str  # "prefill", "extend" or "decode"
    rows: int
    prompt_len: int  # P (prefill), R (extend); 0 for decode
    cache_len: int  # K
    window: int  # decode window (0 for prefill)


@dataclass
class WarmupReport:
    seconds: float
    shapes: list[StepShape] = field(default_factory=list)
    note: str = ""

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.shapes)

    def describe(self) -> str:
        if self.note:
            return f"warm-up: {self.note}"
        extend = f", {self.count('extend')} extend" if self.count("extend") else ""
        return (f"warm-up: {self.count('prefill')} prefill{extend} and {self.count('decode')} decode shapes "
                f"in {self.seconds:.2f} s")


def request_rows(options: GenerationOptions, prompts_per_batch: int) -> int:
    """Rows a batch of prompts occupies on the device: beams or sampled copies multiply them."""
    if options.num_beams > 1:
        return prompts_per_batch * options.num_beams
    if options.do_sample:
        return prompts_per_batch * options.num_return_sequences
    return prompts_per_batch


def step_shapes(options: GenerationOptions, prompts: int, prefix_cache: bool = False) -> list[StepShape]:
    """Every distinct step shape a batch of ``prompts`` prompts can use under ``options``, in run
    order. Beams and sampled copies of a prompt share one prefill of the prompts alone, in a cache
    as long as the padded prompt (``StepRunner.prefill_shared``); decode runs every row.
    ``prefix_cache``: the extends of a prefix cache's hits too."""
    rows = request_rows(options, prompts)
    max_length, max_new = options.max_length, options.max_new_tokens
    # The shortest possible prompt (1 token) has the most steps; shorter rows in a batch can make
    # steps run past the longest row's own budget, so every batch may need this many.
    most_steps = max_length - 1 if max_new is None else min(max_length - 1, max_new)
    shapes: dict[StepShape, None] = {}  # ordered set
    for longest in range(1, max_length + 1):
        # Reach (prompt + new tokens) grows with the prompt, so the longest row reaches furthest.
        furthest = max_length if max_new is None else min(max_length, longest + max_new)
        plan = plan_shapes([longest], [furthest], options)
        prefill = (StepShape("prefill", prompts, plan.prompt_len, plan.prompt_len, 0) if rows > prompts
                   else StepShape("prefill", rows, plan.prompt_len, plan.cache_len, 0))
        shapes[prefill] = None
        if prefix_cache:
            for rest in rest_buckets(plan.prompt_len):
                shapes[StepShape("extend", prefill.rows, rest, prefill.cache_len, 0)] = None
            if prompts > 1:  # a batch's shared prefixes, one row at a time
                shapes[StepShape("prefill", 1, plan.prompt_len, plan.prompt_len, 0)] = None
                for rest in rest_buckets(plan.prompt_len):
                    shapes[StepShape("extend", 1, rest, plan.prompt_len, 0)] = None
        if not options.use_kv_cache:  # every step re-runs the prefill over the whole cache
            shapes[StepShape("prefill", rows, plan.cache_len, plan.cache_len, 0)] = None
            continue
        # Decode steps 0 .. most_steps-2 (the last token needs no step after it). The window only
        # changes when a step needs a slot past it, so jump from one change to the next.
        step = 0
        while step < most_steps - 1:
            window = plan.window(step)
            shapes[StepShape("decode", rows, 0, plan.cache_len, window)] = None
            if window >= plan.cache_len:
                break
            step = max(step + 1, window - longest)  # the first step whose token lands at slot `window`
    return list(shapes)


@torch.no_grad()
def warm_up(generator, options: GenerationOptions, prompts_per_batch: list[int] | int = 1,
            progress: bool = False) -> WarmupReport:
    """Run every step shape once for each batch size in ``prompts_per_batch``; returns what ran
    and how long it took (device synchronised). ``progress``: shapes done on stderr."""
    if not options.static_shapes and not options.bucket_width:
        return WarmupReport(0.0, note="nothing to warm up with dynamic shapes (every length is a new shape)")
    sizes = [prompts_per_batch] if isinstance(prompts_per_batch, int) else sorted(set(prompts_per_batch))
    runner, device = generator.runner, generator.device
    pad = generator.tokenizer.pad_token_id
    start = time.perf_counter()
    prefix = runner.prefix is not None
    shapes = [s for size in sizes for s in step_shapes(options, size, prefix)]
    with Progress(len(shapes), "warm-up", "shapes", enabled=progress) as bar:
        for s in shapes:
            cache = runner.cache(s.rows, s.cache_len)
            if s.kind == "prefill":
                ids = torch.full((s.rows, s.prompt_len), pad, dtype=torch.long, device=device)
                lengths = torch.full((s.rows,), s.prompt_len, dtype=torch.long, device=device)
                runner.prefill(step_input(ids), step_input(lengths), cache)
            elif s.kind == "extend":
                ids = torch.full((s.rows, s.prompt_len), pad, dtype=torch.long, device=device)
                starts = torch.zeros(s.rows, dtype=torch.long, device=device)
                lengths = torch.full((s.rows,), s.prompt_len, dtype=torch.long, device=device)
                runner.extend(step_input(ids), step_input(starts), step_input(lengths), cache)
            else:
                # Any in-window slot will do: requests overwrite every slot they attend before reading it.
                tokens = torch.zeros(s.rows, 1, dtype=torch.long, device=device)
                slots = torch.zeros(s.rows, dtype=torch.long, device=device)
                runner.decode(step_input(tokens), step_input(slots), cache, s.window)
            bar.update()
        generator.backend.synchronize()
    return WarmupReport(time.perf_counter() - start, shapes)


def chunk_sizes(n_prompts: int, batch_size: int) -> list[int]:
    """Batch sizes the CLI will run ``n_prompts`` prompts in: full batches and a smaller last one."""
    sizes = {min(batch_size, n_prompts)}
    if n_prompts > batch_size and n_prompts % batch_size:
        sizes.add(n_prompts % batch_size)
    return sorted(sizes)
