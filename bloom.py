#!/usr/bin/env python3
"""Generate text with BLOOM: ./bloom.py [--weights DIR --model NAME] [options] "prompt" ...

Thin on purpose: it parses arguments, builds a generator, reads prompts, and prints or writes the
results. The model lives in ``bloom_hpu/``, the search in ``generation/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path


def set_hpu_environment(argv: list[str]) -> None:
    """Habana's environment (bloom_hpu/runtime/hpu_env.py), before the first ``import torch``:
    torch's device-backend autoload can import Habana's bridge, which reads it only then. Only
    ``--use_graphs`` is needed from the command line here, so a small parser takes it alone."""
    from bloom_hpu.runtime import hpu_env  # imports no torch

    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--use_graphs", default="t")
    known, _ = early.parse_known_args(argv)
    hpu_env.set_defaults(use_graphs=known.use_graphs.strip().lower() not in ("f", "false", "0", "no", "n"))


# Run as a script, this file's folder (the repository root) is first on sys.path: bloom_hpu/ and
# generation/ import from the clone, installed or not. The HPU environment first, then torch (through
# generation/). The server, the chat shell and the vanilla path import their heavier libraries
# (FastAPI, transformers) only when asked for.
set_hpu_environment(sys.argv[1:])

from bloom_hpu.checkpoint import CheckpointError, resolve_checkpoint  # noqa: E402
from bloom_hpu.data_parallel import split_replicas  # noqa: E402
from bloom_hpu.runtime.backends import DeviceError, make_backend  # noqa: E402
from bloom_hpu.runtime.cpu import CpuOptions, CpuPathError  # noqa: E402
from bloom_hpu.runtime.launch import (check_agreement, exit_process, init_parallel, route_output,  # noqa: E402
                                      shutdown, stop_together, sync_random_seed)
from bloom_hpu.tp import ParallelError  # noqa: E402
from generation.chat.settings import CHAT_FLAGS, HYPERPARAMETERS, chat_options  # noqa: E402
from generation.generator import Generator, parse_dtype  # noqa: E402
from generation.jobs import data_parallel  # noqa: E402
from generation.jobs.evaluate import evaluate, read_passages  # noqa: E402
from generation.jobs.files import check_distinct, replace_file  # noqa: E402
from generation.jobs.inputs import read_prompt_file  # noqa: E402
from generation.jobs.outputs import ResultWriter  # noqa: E402
from generation.jobs.runner import run_requests  # noqa: E402
from generation.request.options import OptionError, build_options, options_help, parse_bool  # noqa: E402
from generation.request.validate import check_prompts  # noqa: E402
from generation.run.batch import InputError  # noqa: E402
from generation.run.prefix_pool import DEFAULT_SIZE as PREFIX_CACHE_DEFAULT  # noqa: E402
from generation.run.streaming import generate_streaming  # noqa: E402
from generation.run.warmup import chunk_sizes, warm_up  # noqa: E402
from generation.search.guesses import parse_speculation  # noqa: E402

ROOT = Path(__file__).resolve().parent

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
    add_model_flags(p.add_argument_group("the model and its weights"))
    add_device_flags(p.add_argument_group("the device and its runtime"))
    add_search_flags(p.add_argument_group("generation (more options: --options, --help_options)"))
    add_io_flags(p.add_argument_group("prompts in, results out"))
    add_jobs_flags(p.add_argument_group("batch jobs (--requests, --eval: docs/batch-jobs.md)"))
    add_launch_flags(p.add_argument_group("several ranks (deepspeed / torchrun: docs/parallelism.md)"))
    add_chat_flags(p.add_argument_group("chat (--chat: an interactive shell; README's Chat section)"))
    add_server_flags(p.add_argument_group("server (--serve: an OpenAI-compatible HTTP server, see docs/serving.md)"))
    return p


def add_model_flags(group) -> None:
    group.add_argument("--weights", help="checkpoint folder, or a folder filled by utils/fetch_weights.py "
                       "(default: the embedded tiny checkpoint, checkpoints/bloom-tiny)")
    group.add_argument("--model", help="model inside --weights, e.g. bloom-560m or bigscience/bloom-7b1")
    group.add_argument("--peft_weights", metavar="DIR",
                       help="a LoRA adapter saved by PEFT (adapter_config.json + adapter_model.*), merged at load")
    group.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="weights and compute dtype")
    group.add_argument("--quantize", choices=["int8", "int4"],
                       help="keep the weights quantized (activations and cache stay in --dtype): int8, one scale per "
                            "output row, about half of bf16's bytes; int4, one scale per --group_size weights of a row, "
                            "about a quarter; see docs/performance.md")
    group.add_argument("--group_size", type=int, metavar="G",
                       help="with --quantize int4: weights per scale, 32, 64 (default), 128 or 256; a smaller group "
                            "keeps more quality, a larger one fewer bytes")
    group.add_argument("--int8_activations", choices=["off", "on", "auto"], default="auto",
                       help="with quantized weights: integer products, the activations entering each product rounded "
                            "to int8 per block of 32 values (as llama.cpp's Q8_0); on a CPU faster prompts, a small "
                            "change in the numbers. auto (default): where this CPU measured them faster (cpu; off on "
                            "a card); the bare flag means on; see docs/performance.md#integer-products---int8_activations")


def add_device_flags(group) -> None:
    group.add_argument("--device", help="cpu, cuda or hpu (default: hpu if present, else cuda, else cpu)")
    group.add_argument("--use_graphs", type=flag_bool, help="capture steps as HPU/CUDA graphs (default t)")
    group.add_argument("--static_shapes", type=flag_bool, help="static-shape recipe (default t)")
    group.add_argument("--limit_hpu_graphs", type=flag_bool,
                       help="hpu: run the prefill without a graph, so its scores are not kept (default: t under "
                            "tensor parallelism, f on one card)")
    group.add_argument("--compile", action="store_true", help="cpu: run the decode step through torch.compile")
    group.add_argument("--cpu_path", default="auto", choices=["auto", "avx512_bf16", "avx2", "onednn", "plain"],
                       help="cpu: auto (default) takes the fastest this CPU can run; avx512_bf16 / avx2 force "
                       "our kernels for that ISA; onednn: no kernels; plain: PyTorch's public operations only")


def add_search_flags(group) -> None:
    group.add_argument("--max_length", type=int, help="prompt + generated tokens per row (default 128)")
    group.add_argument("--batch_size", type=int, default=1, help="prompts per batch (more prompts run in successive batches)")
    group.add_argument("--mode", default="optimized", choices=["optimized", "vanilla"],
                       help="optimized: our static-shape loops; vanilla: transformers generate on the same weights")
    group.add_argument("--seed", type=int, help="random seed (sampling)")
    group.add_argument("--ignore_eos", type=flag_bool, help="t: generate to max_length (default); f: stop each row at EOS")
    group.add_argument("--prefix_cache", default=None, metavar="SIZE",
                       help="keys and values of prompt prefixes seen before are copied, not computed: the pool's "
                            "size, e.g. 512MB, 2GB (default 1GB; 0: off; see docs/prefix-cache.md)")
    group.add_argument("--speculate", metavar="ngram[:K]|draft[:K]",
                       help="speculative decoding: each pass over the weights verifies up to K (1..8, default 4) "
                            "guesses of every row, taken from its own prompt and output (ngram: prompt lookup) or "
                            "from a draft model (draft, with --draft_model); the same tokens, greedy or sampled "
                            "(see docs/performance.md#speculative-decoding)")
    group.add_argument("--draft_model", metavar="DIR",
                       help="with --speculate draft: a smaller BLOOM checkpoint with the same tokenizer (bloom-560m "
                            "for bloom-7b1), loaded beside the model with the same --dtype, --device and --quantize")
    group.add_argument("--options", default="", help='generation options "k=v,k:int=3,flag,!flag" (see --help_options)')
    group.add_argument("--help_options", action="store_true", help="list every generation option and exit")
    group.add_argument("--warmup", action="store_true", help="run every step shape (each bucket) once before the "
                       "first prompt, so no request meets a first-time capture or compile; prints the time taken")


def add_io_flags(group) -> None:
    group.add_argument("--input_file", help="prompts: a JSON list of strings, or a text file with one prompt per line")
    group.add_argument("--output_file", help="write results as a JSON list, one object per prompt")
    group.add_argument("--stream", action="store_true", help="print each prompt's tokens as they are generated")
    group.add_argument("--quiet", action="store_true", help="print only the generated texts")


def add_jobs_flags(group) -> None:
    group.add_argument("--requests", help="batch job: a JSONL file of OpenAI-style completion requests "
                       "(see docs/batch-jobs.md); needs --results")
    group.add_argument("--results", help="--requests: JSONL file the result records are appended to (a rerun "
                       "skips requests already answered); --eval: write the numbers there as JSON")
    group.add_argument("--errors", help="--requests: JSONL file of the lines that failed (default RESULTS.errors.jsonl)")
    group.add_argument("--budget", type=int, default=8192, help="--requests/--eval: max tokens (rows x length) per batch")
    group.add_argument("--eval", help='evaluate last-word accuracy and perplexity on a JSONL of {"text": ...} (LAMBADA)')


def add_launch_flags(group) -> None:
    group.add_argument("--data_parallel", type=int, default=1, metavar="D",
                       help="--requests/--eval under deepspeed/torchrun: the launch's ranks as D model replicas of "
                       "ranks/D tensor-parallel ranks each, splitting the lines (see docs/parallelism.md)")
    group.add_argument("--all_ranks", action="store_true",
                       help="tensor parallel runs: every rank prints (prefixed [rank r]) and writes its own "
                       "--output_file (name.rankR.json), not only rank 0")
    group.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher


def add_chat_flags(group) -> None:
    group.add_argument("--chat", action="store_true", help="talk with the model: >>> prompt, replies streamed, "
                       "/help lists the commands (default max_length 1024 so that the history fits)")
    group.add_argument("--max_tokens", "--max-tokens", type=int, help="--chat: new tokens per reply (default 128)")
    group.add_argument("--sample", type=flag_bool, help="--chat: t: sample (default); f: greedy")
    group.add_argument("--temperature", type=float, help="--chat: sampling temperature (default 0.6)")
    group.add_argument("--top_k", "--top-k", type=int, help="--chat: sample among the k most likely tokens (default 40)")
    group.add_argument("--repetition_penalty", "--repetition-penalty", type=float,
                       help="--chat: penalise tokens already in the conversation (default 1.0: off)")


def add_server_flags(group) -> None:
    group.add_argument("--serve", action="store_true", help="answer /v1/completions and /v1/chat/completions over HTTP")
    group.add_argument("--host", default="127.0.0.1", help="--serve: address to listen on (default 127.0.0.1)")
    group.add_argument("--port", type=int, default=8000, help="--serve: port (default 8000)")
    group.add_argument("--max_batch", type=int, default=8, help="--serve: rows generating at once (default 8)")
    group.add_argument("--bucket_width", type=int, default=32,
                       help="--serve: prompt and attention-window buckets, in tokens (default 32; 0: max_length only)")
    group.add_argument("--max_prefill", type=int, default=4,
                       help="--serve: waiting prompts prefilled together in one step when no row is running (default 4)")
    group.add_argument("--prefill_chunk", type=int, default=64,
                       help="--serve: prompt tokens fed per decode step while rows run, in up to 4 segments (default 64)")
    group.add_argument("--burst_wait_ms", type=float, default=8.0,
                       help="--serve: when no row is running, gather arriving requests until none came for this "
                            "long, then prefill them together (default 8; 0: off)")
    group.add_argument("--max_queue", type=int, default=256, help="--serve: requests waiting before 503 (default 256)")
    group.add_argument("--lora", action="append", metavar="NAME=DIR",
                       help="--serve: a LoRA adapter saved by PEFT, served unmerged beside the base model; a "
                            "request's \"model\": NAME picks it (repeatable)")
    group.add_argument("--api_key", help="--serve: require 'Authorization: Bearer KEY' on /v1/ endpoints")

def read_prompts(args) -> list[str]:
    prompts = list(args.prompts)
    for i, prompt in enumerate(prompts, 1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # bytes that were not UTF-8 reach argv as lone surrogates
            raise UsageError(f"prompt {i} on the command line is not UTF-8 text") from None
    if args.input_file:

        prompts += read_prompt_file(args.input_file)
    if not prompts:
        raise UsageError("no prompts: give them on the command line or with --input_file")
    return prompts


def check_chat_flags(args) -> None:

    given = [name for name in CHAT_FLAGS if getattr(args, name) is not None]
    if not args.chat:
        if given:
            raise UsageError(f"--{given[0]} goes with --chat (to generate, set it in --options, e.g. "
                             f"--options {HYPERPARAMETERS[given[0]]}=...)")
        return
    for flag, used in (("prompts on the command line", args.prompts), ("--input_file", args.input_file),
                       ("--output_file", args.output_file), ("--stream", args.stream), ("--serve", args.serve),
                       ("--requests", args.requests), ("--eval", args.eval), ("--warmup", args.warmup),
                       ("--mode vanilla", args.mode == "vanilla"), ("--batch_size", args.batch_size != 1)):
        if used:
            raise UsageError(f"--chat reads its messages from the keyboard: {flag} cannot be used with it")


def check_flags(args) -> None:
    """Flags that contradict each other, and file paths that would overwrite one another; all
    before the model is loaded."""
    check_chat_flags(args)
    if args.batch_size < 1:
        raise UsageError(f"--batch_size must be >= 1, got {args.batch_size}")
    if args.budget < 1:
        raise UsageError(f"--budget must be >= 1 token, got {args.budget}")
    if args.requests and args.eval:
        raise UsageError("--requests and --eval are two different jobs; run them one at a time")
    job = "--requests" if args.requests else "--eval" if args.eval else None
    if job:
        for flag, given in (("prompts on the command line", args.prompts), ("--input_file", args.input_file),
                            ("--output_file", args.output_file), ("--stream", args.stream)):
            if given:
                raise UsageError(f"{job} reads its own file: {flag} cannot be used with it")
    elif args.results or args.errors:
        raise UsageError("--results and --errors go with --requests (or --results with --eval)")
    if args.errors and not args.requests:
        raise UsageError("--errors goes with --requests")
    if args.speculate:

        speculation = parse_speculation(args.speculate)  # a bad value is named before anything is loaded
        if speculation is not None and speculation.kind == "draft" and not args.draft_model:
            raise UsageError("--speculate draft needs --draft_model DIR (a smaller BLOOM with the same tokenizer)")
        where = "--eval" if args.eval else "--mode vanilla" if args.mode == "vanilla" else None
        if where:  # --eval scores given text (nothing to guess); vanilla is transformers' own loop
            raise UsageError(f"--speculate runs with prompts, --stream, --requests, --chat and --serve, not with {where}")
    if args.draft_model and not (args.speculate and args.speculate.strip().lower().startswith("draft")):
        raise UsageError("--draft_model goes with --speculate draft[:K]")
    if args.quantize and args.mode == "vanilla":
        raise UsageError("--quantize runs in --mode optimized only (vanilla is transformers' own model)")
    if args.int8_activations == "on" and args.mode == "vanilla":
        raise UsageError("--int8_activations runs in --mode optimized only (vanilla is transformers' own model)")
    if args.group_size is not None and args.quantize != "int4":
        raise UsageError("--group_size goes with --quantize int4")
    if args.api_key is not None and not args.api_key.strip():
        raise UsageError("--api_key is empty; give a key, or leave the flag out to serve without one")
    if args.lora and not args.serve:
        raise UsageError("--lora goes with --serve (to merge one adapter into the model, use --peft_weights DIR)")
    if args.lora and args.peft_weights:
        raise UsageError("--lora serves adapters beside the base model; it cannot be combined with --peft_weights")
    lora_adapters(args)

    errors = args.errors
    if args.requests and args.results and not errors:
        errors = str(Path(args.results).with_name(Path(args.results).name + ".errors.jsonl"))
    check_distinct({"--input_file": args.input_file, "--requests": args.requests, "--eval": args.eval},
                   {"--output_file": args.output_file, "--results": args.results, "--errors": errors})


def lora_adapters(args) -> dict[str, str]:
    """--lora NAME=DIR flags as {name: folder}, in order."""
    adapters = {}
    for spec in args.lora or []:
        name, sep, folder = spec.partition("=")
        name, folder = name.strip(), folder.strip()
        if not sep or not name or not folder:
            raise UsageError(f"--lora takes NAME=DIR (a name for requests' \"model\" and a PEFT adapter folder), "
                             f"got {spec!r}")
        if name in adapters:
            raise UsageError(f"--lora: the name {name!r} is given twice")
        adapters[name] = folder
    return adapters


def collect_options(args):

    flags = {name: getattr(args, name) for name in ("max_length", "ignore_eos", "use_graphs", "static_shapes", "seed")}
    if args.chat:

        flags.update({HYPERPARAMETERS[name]: getattr(args, name) for name in CHAT_FLAGS})
        return chat_options(args.options, **flags)
    return build_options(args.options, **{k: v for k, v in flags.items() if v is not None})


def make_generator(args, opts):

    weights = args.weights
    # --model alone is looked up in checkpoints/ (weights None), and said to be missing if it is not
    # there: never replaced by the tiny default.
    if weights is None and args.model is None:
        weights = str(DEFAULT_CHECKPOINT)
        log(f"no --weights given: using the embedded default checkpoint {DEFAULT_CHECKPOINT.relative_to(ROOT)} "
            "(a tiny model trained on the King James Bible; pass --weights for a real model)")
    if args.mode == "vanilla":
        from generation.run.vanilla import VanillaGenerator

        if args.peft_weights:
            raise UsageError("--peft_weights runs in --mode optimized only")
        if args.prefix_cache is not None:
            raise UsageError("--prefix_cache runs in --mode optimized only")
        folder = resolve_checkpoint(weights, args.model)  # weights None: checkpoints/
        return VanillaGenerator(folder, parse_dtype(args.dtype), str(make_backend(args.device, use_graphs=False).device))

    generator = Generator.from_pretrained(
        weights, args.model, dtype=args.dtype, device=args.device, use_graphs=opts.use_graphs,
        compile_steps=args.compile, parallel=PARALLEL, cpu=CpuOptions(path=args.cpu_path),
        peft_weights=args.peft_weights, lora=lora_adapters(args) or None, limit_hpu_graphs=args.limit_hpu_graphs,
        quantize=args.quantize, group_size=args.group_size, int8_activations=args.int8_activations,
        prefix_cache=PREFIX_CACHE_DEFAULT if args.prefix_cache is None else args.prefix_cache,
        speculate=args.speculate,  # with --serve: only to load the draft model (the engine speculates itself)
        draft_model=args.draft_model,
    )
    if args.serve:  # the engine speculates itself (EngineConfig); its offline answers (beams...) do not
        generator.speculation = None
    if generator.adapter is not None:
        log(f"{generator.adapter.describe()}, merged")
    return generator


# Tensor parallelism (deepspeed / torchrun launchers): this rank's Parallel (inside its replica with
# --data_parallel), the whole launch's, the replicas, and whether this rank prints.
PARALLEL = None
WORLD = None
REPLICAS = None
SHOWS_OUTPUT = True


def log(message: str) -> None:
    if SHOWS_OUTPUT:
        print(message, file=sys.stderr, flush=True)


def shows_progress(args) -> bool:
    """Progress on stderr (generation/run/progress.py): not with --quiet, and from rank 0 only, since
    the ranks of a tensor-parallel run share one terminal."""
    return not args.quiet and WORLD.rank == 0


def setup_parallel(args):
    """Join the launcher's process group (a no-op without one); only rank 0 prints from now on."""
    global PARALLEL, SHOWS_OUTPUT, WORLD, REPLICAS

    WORLD = init_parallel(args.device)
    SHOWS_OUTPUT = route_output(WORLD, args.all_ranks)
    sync_random_seed(WORLD)  # sampling without --seed must draw the same tokens on every rank
    if args.data_parallel != 1 and not (args.requests or args.eval or args.serve):
        raise ParallelError("--data_parallel splits the lines of --requests or --eval, or serves replicas with --serve; "
                            "the other modes run one replica")
    PARALLEL, REPLICAS = split_replicas(WORLD, args.data_parallel)
    if PARALLEL.world_size > 1 and args.mode == "vanilla":
        raise ParallelError("--mode vanilla runs in one process; launch it without deepspeed/torchrun")


def check_ranks_agree(args, prompts) -> None:

    values = {k: v for k, v in vars(args).items() if k not in ("local_rank", "all_ranks", "prompts")}
    for flag in ("requests", "eval"):  # the same path may hold different files on different nodes
        if getattr(args, flag):
            values[f"{flag} file"] = file_digest(getattr(args, flag))
    check_agreement(WORLD, {**values, "prompts": prompts})


def file_digest(path: str) -> str:
    """What a rank read at ``path``: a digest of the bytes, or why it could not (the reading itself
    reports that, on every rank alike once they agree)."""

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as error:
        return f"unreadable: {error.strerror or error}"


def rank_output_file(path: str) -> str:
    """Rank 0 writes --output_file itself; with --all_ranks rank r writes name.rankR.json beside it."""
    if PARALLEL.rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{PARALLEL.rank}{p.suffix}"))


def run_file_job(args, opts) -> int:
    """--requests (OpenAI-style batch job) or --eval (LAMBADA-style evaluation)."""
    if args.mode == "vanilla":
        raise UsageError("--requests and --eval run in --mode optimized only")
    if args.requests and not args.results:
        raise UsageError("--requests needs --results FILE (results are appended there)")
    check_ranks_agree(args, [])
    generator = make_generator(args, opts)
    if REPLICAS.count > 1:
        return run_replicated_job(args, generator)
    writes = PARALLEL.rank == 0  # tensor parallel: every rank computes, rank 0 writes
    if args.requests:

        summary = run_requests(generator, args.requests, args.results, errors_path=args.errors,
                               budget=args.budget, progress=shows_progress(args), write=writes)
        cached = (f", {summary.cached_tokens} prompt tokens from the prefix cache"
                  if generator.runner.prefix is not None else "")
        speculated = f", {summary.speculation.describe()}" if summary.speculation is not None else ""
        log(f"{summary.answered} requests answered, {summary.skipped} already done, {summary.errors} failed, "
            f"{summary.completion_tokens} tokens in {summary.seconds:.1f} s{cached}{speculated}")
        return 1 if summary.errors else 0


    result = evaluate(generator, read_passages(args.eval), budget=args.budget, progress=shows_progress(args))
    print(f"passages: {result.passages}  accuracy: {result.accuracy:.4f}  perplexity: {result.perplexity:.3f}  "
          f"last-word perplexity: {result.last_word_perplexity:.3f} (per word: {result.last_word_perplexity_per_word:.3f})")
    if args.results and writes:

        replace_file(args.results, (json.dumps(result.to_dict(), indent=2) + "\n").encode("utf-8"))
    return 0


def run_replicated_job(args, generator) -> int:
    """--requests or --eval split over --data_parallel replicas (generation/jobs/data_parallel.py):
    every rank takes part, rank 0 reports for the whole job."""


    if args.requests:
        summary = data_parallel.run_requests_parallel(generator, args.requests, args.results, REPLICAS,
                                                      errors_path=args.errors, budget=args.budget,
                                                      progress=shows_progress(args))
        if summary is not None:
            cached = (f", {summary.cached_tokens} prompt tokens from the replicas' prefix caches"
                      if generator.runner.prefix is not None else "")
            speculated = f", {summary.speculation.describe()}" if summary.speculation is not None else ""
            log(f"{summary.answered} requests answered by {REPLICAS.count} replicas, {summary.skipped} already done, "
                f"{summary.errors} failed, {summary.completion_tokens} tokens in {summary.seconds:.1f} s{cached}"
                f"{speculated}")
        return 1 if summary is not None and summary.errors else 0

    result = data_parallel.evaluate_parallel(generator, read_passages(args.eval), REPLICAS, budget=args.budget,
                                             progress=shows_progress(args))
    if result is not None:
        print(f"passages: {result.passages}  accuracy: {result.accuracy:.4f}  perplexity: {result.perplexity:.3f}  "
              f"last-word perplexity: {result.last_word_perplexity:.3f} "
              f"(per word: {result.last_word_perplexity_per_word:.3f})")
        if args.results:

            replace_file(args.results, (json.dumps(result.to_dict(), indent=2) + "\n").encode("utf-8"))
    return 0


def run_server(args, opts) -> int:
    """--serve: warm up every bucket, then answer HTTP (generation/serving/)."""
    if args.mode == "vanilla":
        raise UsageError("--serve runs in --mode optimized only")
    if min(args.max_batch, args.max_queue, args.max_prefill, args.prefill_chunk) < 1 or args.bucket_width < 0 \
            or opts.max_length < 2:
        raise UsageError("--max_batch, --max_prefill, --prefill_chunk and --max_queue must be >= 1, --bucket_width >= 0, "
                         "--max_length >= 2")
    if not 0 <= args.burst_wait_ms <= 1000:
        raise UsageError(f"--burst_wait_ms must be between 0 and 1000, got {args.burst_wait_ms:g}")
    from generation.serving.app import serve
    from generation.serving.device_rows import DeviceRows
    from generation.serving.engine import EngineConfig
    from generation.serving.listen import ListenError, bind

    check_ranks_agree(args, [])
    listener = front = None
    if REPLICAS.count > 1:  # D replicas on loopback ports, one front door on --port (serving/replicas.py)
        from generation.serving.dp_serving import open_listeners
        from generation.serving.replicas import FrontDoor

        try:
            ports = open_listeners(args.host, args.port, REPLICAS, PARALLEL.rank == 0)
        except ListenError as error:
            raise UsageError(str(error)) from None
        listener = ports.replica
        front = FrontDoor(ports.urls, ports.front, log, args.max_batch) if ports.front is not None else None
    elif PARALLEL.rank == 0:  # the address first: a busy port is found in a second, not after the load
        try:
            listener = bind(args.host, args.port)
        except ListenError as error:
            raise UsageError(str(error)) from None
    generator = make_generator(args, opts)
    if generator.backend.fast_path != "none":  # with --lora: that decode runs op by op
        log(f"CPU fast path: {generator.backend.fast_path}")
    config = EngineConfig(max_batch=args.max_batch, max_length=opts.max_length, bucket_width=args.bucket_width,
                          max_queue=args.max_queue, max_prefill=args.max_prefill, prefill_chunk=args.prefill_chunk,
                          burst_wait_ms=args.burst_wait_ms, speculation=parse_speculation(args.speculate))
    rows = DeviceRows(generator, config.max_batch, config.max_length, config.bucket_width, config.max_prefill,
                      config.prefill_chunk, config.speculation.shape_k if config.speculation else 0,
                      drafting=config.speculation is not None and config.speculation.kind == "draft")
    if PARALLEL.world_size > 1:
        # Rank 0 answers HTTP and sends each step to the other ranks, which make it too (tp_serving.py);
        # with replicas, each replica's rank 0 to its own ranks, over the replica's group.
        from generation.serving.tp_serving import LeaderRows, RankGone, follow

        if PARALLEL.rank != 0:
            try:
                follow(rows, PARALLEL.group, REPLICAS.leader)
            except RankGone as error:
                raise UsageError(str(error)) from None
            return 0
        rows = LeaderRows(rows, group=PARALLEL.group, source=REPLICAS.leader)
    if front is None:
        serve(generator, config, args.host, args.port, args.api_key, log=log, device_rows=rows, listener=listener)
        return 0
    front.start()  # global rank 0: the front door on a thread, its own replica below
    try:
        serve(generator, config, "127.0.0.1", 0, args.api_key, log=log, device_rows=rows, listener=listener)
    finally:
        front.stop()
    return 0


def run_chat(args, opts) -> int:
    """--chat: the interactive shell (generation/chat/); every rank generates, rank 0 reads and prints."""
    if opts.num_beams > 1 or opts.num_return_sequences > 1:
        raise UsageError("--chat streams one reply at a time: num_beams and num_return_sequences must be 1")
    check_ranks_agree(args, [])
    generator = make_generator(args, opts)
    generator.check_fits(["."], opts)  # the memory of a full-length reply, before the first message
    if generator.load_report is not None:
        log(generator.load_report.describe())
    from generation.chat.shell import run_chat as chat

    return chat(generator, opts, PARALLEL, name=generator.folder.name)


def stream_prompts(args, generator, prompts, opts, writer) -> int:
    """--stream: each prompt, then its continuation piece by piece as it is generated; with
    --output_file each finished result is saved as without --stream."""
    if args.mode == "vanilla":
        raise UsageError("--stream runs in --mode optimized only")

    for prompt in prompts:
        print(prompt, end="", flush=True)
        # On this thread (no worker thread left to tear down while a short run exits).
        result = generate_streaming(generator, prompt, opts, emit=lambda piece: print(piece, end="", flush=True))
        print(flush=True)
        if writer and result is not None:
            writer.add([result])
    if writer:
        writer.finish()
    return 0


def show(args, results) -> None:
    """Print a batch's results: every sequence of each prompt (num_return_sequences)."""
    for result in results:
        texts = [seq.text for seq in result.sequences] or [result.text]
        for k, text in enumerate(texts):
            if args.quiet:
                print(text)
            else:
                label = "output" if len(texts) == 1 else f"output {k + 1}"
                end = "\n" if k == len(texts) - 1 else ""
                if k == 0:
                    print(f"prompt: {result.prompt!r}")
                print(f"{label}: {result.prompt + text!r}\n{end}", end="")


def check_prompts_fit(args, generator, prompts, opts) -> None:
    """Every prompt (numbered over all of them) and the largest batch's memory, before the first
    batch runs: a bad third prompt must not be found after two batches were spent."""

    ids = check_prompts(generator.tokenizer, prompts, opts)
    size = 1 if args.stream else min(args.batch_size, len(prompts))
    longest = max(range(len(prompts)), key=lambda i: len(ids[i]))
    generator.check_fits([prompts[longest]] * size, opts)


def run(args) -> int:
    if args.help_options:

        print(options_help())
        return 0
    check_flags(args)
    setup_parallel(args)
    opts = collect_options(args)
    if args.serve:
        return run_server(args, opts)
    if args.chat:
        return run_chat(args, opts)
    if args.requests or args.eval:
        return run_file_job(args, opts)
    prompts = read_prompts(args)
    if args.mode == "vanilla" and (args.stream or args.warmup):
        raise UsageError(f"{'--stream' if args.stream else '--warmup'} runs in --mode optimized only")
    if args.stream and opts.num_return_sequences > 1:
        raise UsageError("--stream shows one sequence per prompt; leave it out to see all num_return_sequences")
    check_ranks_agree(args, prompts)
    generator = make_generator(args, opts)
    check_prompts_fit(args, generator, prompts, opts)
    if generator.load_report is not None:
        log(generator.load_report.describe())
    fast_path = getattr(getattr(generator, "backend", None), "fast_path", "none")  # vanilla: no backend
    if fast_path != "none":
        log(f"CPU fast path: {fast_path}")
    if args.warmup:

        sizes = [1] if args.stream else chunk_sizes(len(prompts), args.batch_size)
        log(warm_up(generator, opts, sizes, progress=shows_progress(args)).describe())

    writer = ResultWriter(rank_output_file(args.output_file)) if args.output_file and SHOWS_OUTPUT else None
    if args.stream:
        return stream_prompts(args, generator, prompts, opts, writer)
    for first in range(0, len(prompts), args.batch_size):
        chunk = prompts[first : first + args.batch_size]
        results = generator.generate(chunk, opts, progress=shows_progress(args))
        if writer:
            writer.add(results)  # saved before printing: a closed pipe must not lose the batch
        show(args, results)
        if writer and first + args.batch_size >= len(prompts):
            writer.finish()  # a device or FIFO gets the whole list now, before the last stats line
        stats = generator.last_stats
        if not args.quiet:
            prefix = getattr(getattr(generator, "runner", None), "prefix", None)  # --mode vanilla has none
            cached = f", cached prompt tokens: {stats.cached_tokens}" if prefix is not None else ""
            speculated = f", {stats.speculation.describe()}" if getattr(stats, "speculation", None) else ""
            print(f"batch {first // args.batch_size + 1}: {stats.seconds:.3f} s, {stats.new_tokens} tokens, "
                  f"{stats.tokens_per_second:.1f} tokens/s, graphs: {stats.graph_count}{cached}{speculated}", flush=True)
    return 0


def bare_flags_as_on(argv: list[str]) -> list[str]:
    """``--int8_activations`` alone (not followed by off, on or auto) means on, as before it took a value."""
    return [f"{a}=on" if a == "--int8_activations" and (i + 1 == len(argv) or argv[i + 1] not in ("off", "on", "auto"))
            else a for i, a in enumerate(argv)]


def main(argv=None) -> int:
    args = build_parser().parse_args(bare_flags_as_on(sys.argv[1:] if argv is None else list(argv)))

    try:
        return run(args)
    except BrokenPipeError:
        # The reader went away (| head): what was generated is already saved; say nothing more,
        # and keep Python from failing again when it flushes stdout at exit.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout is not a file (embedded, captured): nothing will flush to a closed pipe
        return 1
    except (UsageError, CheckpointError, InputError, OptionError, DeviceError, CpuPathError, ValueError,
            OSError) as error:
        # Everything the user can fix: one line, no traceback. A ParallelError is raised alike on
        # every rank, so only rank 0 says it; any other error may be this rank's alone.
        if SHOWS_OUTPUT or not isinstance(error, ParallelError):
            print(f"error: {error}", file=sys.stderr, flush=True)
        if isinstance(error, ParallelError):

            stop_together()  # the silent ranks leave only once rank 0 has said why
        return 1
    except KeyboardInterrupt:
        log("interrupted")
        return 130
    finally:
        shutdown()


if __name__ == "__main__":

    exit_process(main())
