#!/usr/bin/env python3
"""Structured output's cost (docs/structured-output.md), in one process on the same weights.

* ``libraries``: llguidance, xgrammar and outlines-core on a vocabulary of BLOOM's size (250,880
  tokens): tokenizer load, schema compile (first and repeated), one mask (``grammar_libraries.py``;
  the libraries not installed are rows that say so).
* ``step``: a bloom-560m-shaped random checkpoint (``generate_bench.checkpoint_folder``) with a
  byte-level tokenizer of BLOOM's size (``grammar_libraries.bloom_sized_tokenizer``, in a copy of
  the folder whose weights are links), 16 rows through ``Generator.generate``: ms per decode step
  (from the first token to the last, the prefill left out) with no constraint, with half the
  rows and with every row under a nested-object JSON schema,
  round-robin over ``--repeats``; and the time to first token (``max_new_tokens=1``) of one
  prompt without a schema and with a repeated one (its compile cached).

    python bench/structured_bench.py libraries
    python bench/structured_bench.py step --rows 16 --new_tokens 16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.grammar_libraries import NESTED_SCHEMA, bloom_sized_tokenizer, compare  # noqa: E402
from bench.prefix_bench import machine  # noqa: E402


def libraries(args) -> None:
    print(f"# {machine()}; vocabulary {args.vocab}")
    print(f"{'library':<14} {'tokenizer ms':>12} {'compile ms':>11} {'again ms':>9} {'mask ms median':>15} "
          f"{'mean':>7} {'max':>7}")
    for name, row in compare(args.vocab, args.budget_s):
        if "note" in row:
            print(f"{name:<14} {row['note']}")
            continue
        mask = row["mask_ms"]
        again = "-" if row["compile_cached_ms"] is None else f"{row['compile_cached_ms']:.2f}"
        print(f"{name:<14} {row['tokenizer_ms']:>12.0f} {row['compile_first_ms']:>11.2f} {again:>9} "
              f"{mask['median']:>15.4f} {mask['mean']:>7.3f} {mask['max']:>7.2f}")


def bloom_sized_copy(folder: Path) -> Path:
    """``folder`` with a tokenizer of BLOOM's size (the weights linked, not copied)."""
    out = folder.with_name(folder.name + "-bloom-vocab")
    out.mkdir(exist_ok=True)
    for item in folder.iterdir():
        target = out / item.name
        if item.name == "tokenizer.json" or target.exists():
            continue
        if item.suffix in (".safetensors", ".bin"):
            target.symlink_to(item.resolve())
        else:
            shutil.copy(item, target)
    if not (out / "tokenizer.json").exists():
        (out / "tokenizer.json").write_text(bloom_sized_tokenizer(json.loads((folder / "config.json").read_text())["vocab_size"]))
    return out


def step(args) -> None:
    from bench.generate_bench import checkpoint_folder
    from generation.generator import Generator
    from generation.request.grammar import grammar_from_fields

    folder = bloom_sized_copy(checkpoint_folder(args.config, torch.float32 if args.dtype == "fp32" else torch.bfloat16))
    generator = Generator.from_pretrained(folder, dtype=args.dtype)
    prompts = [f"Record number {i} of the register reads as follows:" for i in range(args.rows)]
    schema = grammar_from_fields(guided_json=NESTED_SCHEMA)
    variants = {"no constraint": [None] * args.rows,
                "half the rows": [schema if i % 2 else None for i in range(args.rows)],
                "every row": [schema] * args.rows}
    options = dict(max_new_tokens=args.new_tokens, max_length=64, ignore_eos=True)

    def per_step(grammars) -> tuple[float, int]:
        """ms per decode step: from the first token's hand-out to the last's, over the steps
        between (each a token choice, its masks, and a decode), the prefill left out."""
        stamps = []
        generator.generate(prompts, grammar_each=grammars, on_step=lambda tokens, done: stamps.append(
            time.perf_counter()), **options)
        return (stamps[-1] - stamps[0]) * 1000 / max(len(stamps) - 1, 1), len(stamps)

    for grammars in variants.values():  # warm-up: graphs, the vocabulary read, the compile
        per_step(grammars)
    times = {name: [] for name in variants}
    steps = {}
    names = list(variants)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            ms, steps[name] = per_step(variants[name])
            times[name].append(ms)
    mask_ms = mask_time(per_step, variants["every row"])
    print(f"# {machine()}; {args.config} {args.dtype}, {args.rows} rows, up to {args.new_tokens} new tokens; "
          f"load {os.getloadavg()[0]:.2f}")
    base = statistics.median(times["no constraint"])
    for name in names:
        ms = statistics.median(times[name])
        print(f"{name:<14} {ms:8.1f} ms/step (first to last token of {steps[name]})  "
              f"x{ms / base:.3f}")
    print(f"the mask alone, every row: {mask_ms:.1f} ms/step (matchers {args.rows} rows + applying it), "
          f"{100 * mask_ms / base:.1f}% of an unconstrained step")

    def first_token(**extra) -> float:
        runs = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            generator.generate(prompts[:1], max_new_tokens=1, max_length=64, **extra)
            runs.append((time.perf_counter() - start) * 1000)
        return statistics.median(runs[1:])

    plain, constrained = first_token(), first_token(guided_json=NESTED_SCHEMA)
    print(f"time to first token: {plain:.1f} ms without a schema, {constrained:.1f} ms with a repeated one "
          f"(+{constrained - plain:.1f} ms)")


def mask_time(per_step, grammars) -> float:
    """ms per step spent in the mask itself (the matchers taking the last tokens and filling the
    bitmask, its copy, and its application to the scores), timed inside a generate call."""
    from generation.search import choose

    spent, real_masks, real_allow = [], choose.GrammarSteps.masks, choose.allow

    def timed(function):
        def run(*args):
            start = time.perf_counter()
            out = function(*args)
            spent.append(time.perf_counter() - start)
            return out
        return run

    choose.GrammarSteps.masks, choose.allow = timed(real_masks), timed(real_allow)
    try:
        runs = []
        for _ in range(3):
            spent.clear()
            _, steps = per_step(grammars)
            runs.append(sum(spent) * 1000 / steps)
    finally:
        choose.GrammarSteps.masks, choose.allow = real_masks, real_allow
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    lib = sub.add_parser("libraries")
    lib.add_argument("--vocab", type=int, default=250880)
    lib.add_argument("--budget_s", type=float, default=120.0, help="outlines-core's compile is abandoned past this")
    run = sub.add_parser("step")
    run.add_argument("--config", default="bloom-560m")
    run.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    run.add_argument("--rows", type=int, default=16)
    run.add_argument("--new_tokens", type=int, default=16)
    run.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    libraries(args) if args.what == "libraries" else step(args)


if __name__ == "__main__":
    main()
