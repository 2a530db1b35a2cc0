#!/usr/bin/env python3
"""Generate text with BLOOM: ./bloom.py [--weights DIR --model NAME] [options] "prompt" ...

Thin on purpose: it parses arguments, builds a generator, reads prompts, and prints or writes the
results. The model lives in ``bloom_hpu/``, the search in ``generation/``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from generation.options import parse_bool  # noqa: E402  (light imports first)

DEFAULT_CHECKPOINT = ROOT / "checkpoints" / "bloom-tiny"


class UsageError(Exception):
    """Bad command-line input; printed as one line."""


def flag_bool(text: str) -> bool:
    try:
        return parse_bool(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bloom.py",
        description="Generate text with BLOOM models on Gaudi (hpu), CUDA or CPU, with static shapes.",
        epilog="Generation options (sampling, beams, penalties...): --options \"k=v,...\"; list: --help_options.",
    )
    p.add_argument("prompts", nargs="*", help="prompts to continue")
    p.add_argument("--weights", help="checkpoint folder, or a folder filled by utils/fetch_weights.py "
                   "(default: the embedded tiny random checkpoint)")
    p.add_argument("--model", help="model inside --weights, e.g. bloom-560m or bigscience/bloom-7b1")
    p.add_argument("--max_length", type=int, help="prompt + generated tokens per row (default 128)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights and compute dtype")
    p.add_argument("--device", help="cpu, cuda or hpu (default: hpu if present, else cuda, else cpu)")
    p.add_argument("--batch_size", type=int, default=1, help="prompts per batch (more prompts run in successive batches)")
    p.add_argument("--mode", default="optimized", choices=["optimized", "vanilla"],
                   help="optimized: our static-shape loops; vanilla: transformers generate on the same weights")
    p.add_argument("--seed", type=int, help="random seed (sampling)")
    p.add_argument("--input_file", help="prompts: a JSON list of strings, or a text file with one prompt per line")
    p.add_argument("--output_file", help="write results as a JSON list, one object per prompt")
    p.add_argument("--ignore_eos", type=flag_bool, help="t: generate to max_length (default); f: stop each row at EOS")
    p.add_argument("--use_graphs", type=flag_bool, help="capture steps as HPU/CUDA graphs (default t)")
    p.add_argument("--static_shapes", type=flag_bool, help="static-shape recipe (default t)")
    p.add_argument("--options", default="", help='generation options "k=v,k:int=3,flag,!flag" (see --help_options)')
    p.add_argument("--help_options", action="store_true", help="list every generation option and exit")
    p.add_argument("--compile", action="store_true", help="cpu: run the decode step through torch.compile")
    p.add_argument("--quiet", action="store_true", help="print only the generated texts")
    return p


def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    if args.input_file:
        from generation.inputs import read_prompt_file

        prompts += read_prompt_file(args.input_file)
    if not prompts:
        raise UsageError("no prompts: give them on the command line or with --input_file")
    return prompts


def collect_options(args):
    from generation.options import build_options

    flags = {name: getattr(args, name) for name in ("max_length", "ignore_eos", "use_graphs", "static_shapes", "seed")}
    return build_options(args.options, **{k: v for k, v in flags.items() if v is not None})


def make_generator(args, opts):
    from generation.generator import Generator, parse_dtype

    weights = args.weights
    if weights is None:
        weights = str(DEFAULT_CHECKPOINT)
        log(f"no --weights given: using the embedded default checkpoint {DEFAULT_CHECKPOINT.relative_to(ROOT)} "
            "(tiny, random weights: the output is gibberish; pass --weights for a real model)")
    if args.mode == "vanilla":
        from bloom_hpu.backends import make_backend
        from bloom_hpu.checkpoint import resolve_checkpoint
        from generation.vanilla import VanillaGenerator

        folder = resolve_checkpoint(weights, args.model)
        return VanillaGenerator(folder, parse_dtype(args.dtype), str(make_backend(args.device, use_graphs=False).device))
    return Generator.from_pretrained(
        weights, args.model, dtype=args.dtype, device=args.device, use_graphs=opts.use_graphs,
        compile_steps=args.compile,
    )


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run(args) -> int:
    if args.help_options:
        from generation.options import options_help

        print(options_help())
        return 0
    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    opts = collect_options(args)
    prompts = read_prompts(args)
    generator = make_generator(args, opts)
    from generation.outputs import ResultWriter

    writer = ResultWriter(args.output_file) if args.output_file else None
    for first in range(0, len(prompts), args.batch_size):
        chunk = prompts[first : first + args.batch_size]
        results = generator.generate(chunk, opts)
        for result in results:
            if args.quiet:
                print(result.text)
            else:
                print(f"prompt: {result.prompt!r}\noutput: {result.prompt + result.text!r}\n")
        if writer:
            writer.add(results)
        stats = generator.last_stats
        if not args.quiet:
            print(f"batch {first // args.batch_size + 1}: {stats.seconds:.3f} s, {stats.new_tokens} tokens, "
                  f"{stats.tokens_per_second:.1f} tokens/s, graphs: {stats.graph_count}", flush=True)
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from bloom_hpu.backends import DeviceError
    from bloom_hpu.checkpoint import CheckpointError
    from generation.batch import InputError
    from generation.options import OptionError

    try:
        return run(args)
    except (UsageError, CheckpointError, InputError, OptionError, DeviceError, ValueError, OSError) as error:
        # Everything the user can fix: one line, no traceback.
        log(f"error: {error}")
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130


if __name__ == "__main__":
    sys.exit(main())
