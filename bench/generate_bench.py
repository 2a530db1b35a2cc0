#!/usr/bin/env python3
"""Side-by-side benchmark: our static-shape generator against transformers ``generate``.

In one process and on the same weights it runs several variants of one request (batch size, prompt
length, new tokens, beams...) and prints one table:

* ``ours``          the recipe: static shapes (or buckets with --bucket_width), graphs on
* ``ours+int8``     the same with int8 weights (``--quantize int8``; its ``x floor`` is against its own
                    bytes)
* ``ours+int4``     the same with int4 weights (``--quantize int4 --group_size`` this run's
                    ``--group_size``; its ``x floor`` against its own bytes)
* ``ours+int8i``, ``ours+int4i``  the same with integer products (``--int8_activations``: the
                    activations rounded to int8 per block of 32, multiplied in integer arithmetic)
* ``ours+compile``  the same with the decode step through ``torch.compile`` (--compile)
* ``ours+fp32``     the same with the model in fp32 whatever ``--dtype`` is: the fp32 baseline of
                    a bf16 run (its own weights and floor)
* ``op by op``      CPU: the decode step and the prompt attention run op by op from Python, not
                    as one C++ call each
* ``static off``    shapes follow the batch (``static_shapes=false``)
* ``graphs off``    no graph capture/replay (``use_graphs=false``; on cpu the same as ``ours``)
* ``transformers``  ``BloomForCausalLM.generate`` on the same checkpoint (the baseline)

How it measures (what a performance engineer would trust):

* every variant is first run ``--warmup`` times untimed (graph capture, compilation, allocator);
  then the timed runs go round-robin over the variants (repeat r of each before repeat r+1 of
  any, each round starting with the next variant), so a drift in the machine's load hits every
  variant alike;
* time to first token = median wall time of a request with ``max_new_tokens=1`` (tokenize,
  prefill, first token, back on the host); decode ms/token = (median time of the full request
  minus median TTFT) / (new_tokens - 1); both end with a device synchronisation, because every
  request returns its tokens to the host;
* peak memory = the peak of what one extra, untimed request allocates beyond what was allocated
  before it (CUDA: ``max_memory_allocated``; CPU: the profiler's allocation events), and
  ``mem x`` = (weights + KV cache + that peak) / (weights + KV cache), how far the peak goes past
  what must be held (transformers' cache lives inside its request, so its peak counts from the
  weights and is compared with the exact cache it needs);
* the floor: the bytes one decode step must read (every weight once, the LM head included, plus the
  keys and values in the attention window) divided by the memory bandwidth measured in this run
  (a large read-only reduction, best of 3 in every timed round, median over the rounds); ``x floor``
  is decode ms/token divided by that floor.

Usage (the tiny embedded checkpoint, then a bloom-560m-shaped random one in bf16):

    python bench/generate_bench.py --config tiny --new_tokens 32
    python bench/generate_bench.py --config bloom-560m --dtype bf16 --prompt_len 128 --new_tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bloom_hpu.quantize import weight_bytes  # noqa: E402
from bloom_hpu.runtime.backends import make_backend  # noqa: E402
from bloom_hpu.runtime.cpu import PATHS, CpuOptions  # noqa: E402
from bloom_hpu.runtime.steps import StepRunner  # noqa: E402
from generation.run.batch import make_batch  # noqa: E402
from generation.generator import Generator, parse_dtype  # noqa: E402
from generation.request.options import build_options  # noqa: E402

TINY = ROOT / "checkpoints" / "bloom-tiny"
CORPUS = ROOT / "utils" / "tiny_corpus.txt"
# Random checkpoints of real model shapes: (vocab, hidden, layers, heads) as in their config.json.
SHAPES = {"bloom-560m": (250880, 1024, 24, 16), "bloom-1b1": (250880, 1536, 24, 16),
          # The GPU target (one H100, bf16, batch 1). Drawing it takes ~60 GB of host memory
          # once (fp32 draws, then the bf16 copy written); 14 GB on disk.
          "bloom-7b1": (250880, 4096, 30, 32)}
VARIANTS = ("ours", "ours+int8", "ours+int4", "ours+int8i", "ours+int4i", "ours+compile", "ours+fp32", "op by op", "static off", "graphs off", "transformers")


@dataclass
class Row:
    variant: str
    ttft_ms: float | None = None
    decode_ms_per_token: float | None = None
    tokens_per_s: float | None = None
    peak_mb: float | None = None
    graphs: int | None = None
    x_floor: float | None = None
    ttft_vs_hf: float | None = None  # ours / transformers: below 1 is faster
    decode_vs_hf: float | None = None
    tokens_per_s_vs_hf: float | None = None  # ours / transformers: above 1 is faster
    cache_mb: float | None = None  # KV cache held between requests (ours: pooled, preallocated)
    memory_ratio: float | None = None  # (weights + cache + peak) / (weights + cache)
    runs_ms: list[float] = field(default_factory=list)  # full-request wall times, for the noise


# --------------------------------------------------------------------------- weights and prompts


def checkpoint_folder(config: str, dtype: torch.dtype) -> Path:
    """The embedded tiny checkpoint, a cached random checkpoint of a real shape, or a folder."""
    if config == "tiny":
        return TINY
    if config in SHAPES:
        from utils.random_checkpoint import make_random_checkpoint

        vocab, hidden, layers, heads = SHAPES[config]
        store = "bf16" if dtype == torch.bfloat16 else "fp32"
        out = Path(os.environ.get("BLOOM_BENCH_CACHE", Path(tempfile.gettempdir()) / "bloom_bench")) / f"{config}-{store}"
        if not (out / "config.json").exists():
            log(f"writing a random {config}-shaped checkpoint to {out} (once)")
            make_random_checkpoint(out, vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=heads,
                                   dtype=torch.bfloat16 if store == "bf16" else torch.float32)
        return out
    folder = Path(config)
    if not (folder / "config.json").exists():
        raise SystemExit(f"error: --config must be tiny, {', '.join(SHAPES)} or a checkpoint folder; got {config!r}")
    return folder


def make_prompts(tokenizer, batch_size: int, prompt_len: int) -> list[str]:
    """``batch_size`` different prompts of exactly ``prompt_len`` tokens (text that re-encodes to
    that many), cut from the corpus, so both implementations see the same token counts."""
    ids = tokenizer.encode(CORPUS.read_text())
    while len(ids) < prompt_len + 50 * batch_size:
        ids = ids + ids
    prompts, offset = [], 0
    while len(prompts) < batch_size and offset < len(ids) - prompt_len:
        text = tokenizer.decode(ids[offset : offset + prompt_len])
        if len(tokenizer.encode(text)) == prompt_len and text not in prompts:
            prompts.append(text)
            offset += 13
        else:
            offset += 1
    if len(prompts) < batch_size:
        raise SystemExit(f"error: could not cut {batch_size} prompts of {prompt_len} tokens from the corpus")
    return prompts


# --------------------------------------------------------------------------- measuring


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    """Wall seconds of ``fn()``, between two device synchronisations."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def peak_memory(fn, device: torch.device) -> float:
    """Peak bytes allocated during ``fn()`` beyond what was allocated before it.

    CUDA: the caching allocator's peak. CPU: the resident set cannot tell (freed pages stay with the
    process), so the profiler's memory events are replayed in time order: each op's own allocations
    minus frees, the running sum's maximum being the peak of live tensors made by ``fn``.
    """
    if device.type == "cuda":
        synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def read_bandwidth(device: torch.device, mbytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a read-only pass over a buffer far larger than the caches (best of ``repeats``)."""
    buffer = torch.ones(mbytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    for _ in range(repeats):
        best = min(best, timed(lambda: buffer.sum(), device))
    del buffer
    return mbytes * 2**20 / best


# --------------------------------------------------------------------------- running the variants


@dataclass
class Variant:
    name: str
    generate: Callable[[int], object]  # generate(max_new_tokens): one request
    describe: Callable[[Row], None] = lambda row: None  # fill what only the variant knows, free it
    model: object = None  # its own model, when its weights differ from the base's (quantized): its own floor


def sampling(args) -> dict:
    """The options of ``--do_sample``: temperature 1, no top-k or top-p, a fixed seed."""
    return dict(do_sample=True, seed=0) if args.do_sample else {}


def ours_variant(base: Generator, variant: str, args, prompts) -> Variant:
    quantized = variant in ("ours+int8", "ours+int4", "ours+int8i", "ours+int4i")
    if quantized:
        mode = variant.removeprefix("ours+").removesuffix("i")
        gen = Generator.from_pretrained(base.folder, dtype=args.dtype, device=args.device, quantize=mode,
                                        group_size=args.group_size if mode == "int4" else None,
                                        int8_activations=variant.endswith("i"), cpu=CpuOptions(path=args.cpu_path))
        backend = gen.backend
    elif variant == "ours+fp32":
        gen = Generator.from_pretrained(base.folder, dtype="fp32", device=args.device, cpu=CpuOptions(path=args.cpu_path))
        backend = gen.backend
    elif variant == "ours+compile":
        # Its own copy of the weights: the shared model may have been packed for eager CPU steps
        # (see Backend.prepare_model), and the compiled step packs its own.
        gen = Generator.from_pretrained(base.folder, dtype=args.dtype, device=args.device, compile_steps=True,
                                        cpu=CpuOptions(path=args.cpu_path))
        backend = gen.backend
    else:
        backend = make_backend(args.device, use_graphs=variant != "graphs off", cpu=CpuOptions(path=args.cpu_path))
        gen = Generator(base.model, base.tokenizer, StepRunner(base.model, backend), base.folder)
    opts = build_options(
        max_length=args.max_length, bucket_width=args.bucket_width, num_beams=args.num_beams,
        static_shapes=variant != "static off", use_graphs=variant != "graphs off", ignore_eos=True,
        **sampling(args),
    )

    def describe(row: Row) -> None:
        row.graphs = backend.graph_count()
        row.cache_mb = sum(c.nbytes for c in gen.runner._caches.values()) / 2**20
        gen.runner.release_caches()

    def generate(n: int):
        if variant != "op by op":
            return gen.generate(prompts, opts.updated(max_new_tokens=n))
        with gen.backend.cpu_plan.op_by_op():  # the shared model without its one-call CPU steps
            return gen.generate(prompts, opts.updated(max_new_tokens=n))

    return Variant(variant, generate, describe, gen.model if quantized or variant == "ours+fp32" else None)


def transformers_variant(folder: Path, args, prompts, device) -> Variant:
    from generation.run.vanilla import VanillaGenerator

    hf = VanillaGenerator(folder, parse_dtype(args.dtype), str(device))
    opts = build_options(max_length=args.max_length, num_beams=args.num_beams, ignore_eos=True, **sampling(args))
    return Variant("transformers", lambda n: hf.generate(prompts, opts.updated(max_new_tokens=n)))


@dataclass
class Rounds:
    """How many timed rounds ``time_variants`` runs: ``repeats`` when ``min_repeats`` is None (this
    script's way), else adaptive: at least ``min_repeats``, at most ``repeats``, stopping once the
    full requests timed add up to ``min_timed_s`` (a long request already averages over many steps)
    or, from the second round, once every variant's full requests agree within ``spread`` (their
    range over their median). ``agree``: turns this process's stop into the one every rank takes
    (a tensor-parallel run's ranks must time the same rounds)."""
    repeats: int
    min_repeats: int | None = None
    min_timed_s: float = 0.0
    spread: float = 0.0
    agree: Callable[[bool], bool] = lambda stop: stop

    def done(self, full: dict[str, list[float]]) -> bool:
        count = len(next(iter(full.values())))
        if count >= self.repeats:
            return True
        if self.min_repeats is None or count < self.min_repeats:
            return False
        long_enough = all(sum(times) >= self.min_timed_s for times in full.values())
        steady = count >= 2 and all((max(t) - min(t)) <= self.spread * statistics.median(t) for t in full.values())
        return self.agree(long_enough or steady)


def time_variants(variants: list[Variant], *, warmup: int, repeats: int | Rounds, new_tokens: int, device,
                  each_round: Callable[[], None] = lambda: None, warmup_tokens: int | None = None) -> tuple[dict, dict]:
    """Warm every variant up, then time TTFT and full requests of each, round-robin: repeat r of
    every variant runs before repeat r+1 of any, so a drift in the machine's load (this shared CPU
    moved by 30% within minutes) hits every variant alike and the ratios hold; the order rotates
    from round to round. ``each_round`` runs at the start of every round. ``repeats``: the rounds,
    or a ``Rounds`` to stop adaptively. ``warmup_tokens``: each warm-up is a one-token request and
    a ``new_tokens`` one, or, given, one request of this many (with static shapes 2 runs every
    step's shape: the prompt and a decode step). Returns ({name: TTFT seconds of each round},
    {name: full-request seconds of each round}); also what utils/profile_configs.py times each
    configuration with."""
    rounds = repeats if isinstance(repeats, Rounds) else Rounds(repeats)
    for variant in variants:
        log(f"warming up {variant.name} ...")
        for _ in range(warmup):
            if warmup_tokens is None:
                variant.generate(1)
            variant.generate(warmup_tokens or new_tokens)
    ttft = {v.name: [] for v in variants}
    full = {v.name: [] for v in variants}
    repeat = 0
    while not rounds.done(full):
        log(f"timed round {repeat + 1}/{rounds.repeats}")
        each_round()
        # Each round starts with the next variant, so none always runs first (after the bandwidth pass).
        for v in variants[repeat % len(variants):] + variants[: repeat % len(variants)]:
            ttft[v.name].append(timed(lambda: v.generate(1), device))
            full[v.name].append(timed(lambda: v.generate(new_tokens), device))
        repeat += 1
    return ttft, full


def timing_row(name: str, ttft: list[float], full: list[float], batch_size: int, new_tokens: int) -> Row:
    """Medians of a variant's timings (seconds) as a row: TTFT, decode ms/token = (full - TTFT) /
    (new_tokens - 1), tokens/s = the tokens the request returns (beams: the returned sequences) / full."""
    row = Row(name, runs_ms=[round(t * 1e3, 2) for t in full])
    row.ttft_ms = statistics.median(ttft) * 1e3
    full_s = statistics.median(full)
    if new_tokens > 1:
        row.decode_ms_per_token = max(full_s * 1e3 - row.ttft_ms, 0.0) / (new_tokens - 1)
    row.tokens_per_s = batch_size * new_tokens / full_s
    return row


def measure(variants: list[Variant], args, device) -> tuple[list[Row], list[float]]:
    """``time_variants`` over ``variants``, with the read bandwidth (best of 3) measured at the
    start of each round, for a floor taken under the same conditions as the requests, and the
    peak memory of one more request of each: returns (rows, bandwidth of each round in bytes/s)."""
    bandwidths = []
    ttft, full = time_variants(variants, warmup=args.warmup, repeats=args.repeats, new_tokens=args.new_tokens,
                               device=device,
                               each_round=lambda: bandwidths.append(read_bandwidth(device, args.bandwidth_mb, repeats=3)))
    rows = []
    for v in variants:
        row = timing_row(v.name, ttft[v.name], full[v.name], args.batch_size, args.new_tokens)
        row.peak_mb = peak_memory(lambda: v.generate(args.new_tokens), device) / 2**20
        v.describe(row)
        rows.append(row)
    return rows, bandwidths


# --------------------------------------------------------------------------- the table


def decode_bytes(model, args, plan) -> int:
    """Bytes one decode step reads: every weight once, plus keys and values inside the window."""
    weights = weight_bytes(model)  # quantized weights and their scales as such
    cfg = model.config
    element = model.ln_f.weight.element_size()
    windows = [plan.window(s) for s in range(max(args.new_tokens - 1, 1))]
    rows = args.batch_size * args.num_beams
    kv = 2 * cfg.n_layer * rows * cfg.n_head * cfg.head_dim * element * statistics.mean(windows)
    return int(weights + kv)


def fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


HEADER = ("variant", "TTFT ms", "decode ms/tok", "tok/s", "peak MB", "mem x", "graphs", "x floor",
          "TTFT/HF", "decode/HF", "tok/s vs HF")


def cells(r: Row, ttft_digits: int = 2) -> tuple[str, ...]:
    """One row's cells, in HEADER's order."""
    return (r.variant, fmt(r.ttft_ms, ttft_digits), fmt(r.decode_ms_per_token), fmt(r.tokens_per_s, 1),
            fmt(r.peak_mb, 1), fmt(r.memory_ratio, 3), fmt(r.graphs), fmt(r.x_floor), fmt(r.ttft_vs_hf),
            fmt(r.decode_vs_hf), fmt(r.tokens_per_s_vs_hf))


def markdown_table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    lines += ["| " + " | ".join(cells(r, ttft_digits=1)) + " |" for r in rows]
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = [HEADER] + [cells(r) for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(HEADER))]
    out = ["  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths)))
           for line in lines]
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help=f"tiny, {', '.join(SHAPES)} (random weights) or a checkpoint folder")
    p.add_argument("--batch_size", type=int, default=1)
    p.add_argument("--prompt_len", type=int, default=16, help="tokens per prompt")
    p.add_argument("--new_tokens", type=int, default=32, help="new tokens per row (EOS ignored)")
    p.add_argument("--num_beams", type=int, default=1)
    p.add_argument("--do_sample", action="store_true", help="sample (temperature 1, seeded) instead of greedy")
    p.add_argument("--max_length", type=int, default=128, help="static shape: prompt + new tokens")
    p.add_argument("--bucket_width", type=int, default=0, help="pad and size in multiples of this (0: off)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--group_size", type=int, default=64, help="ours+int4: weights per scale")
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu_path", default="auto", choices=PATHS,
                   help="cpu: the fast path of our variants (auto: the fastest this CPU runs; avx2 on an "
                   "AVX-512 CPU times the AVX2 kernels)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per variant before timing")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per variant (medians are reported)")
    p.add_argument("--variants", default="ours,static off,transformers",
                   help=f"comma-separated, from: {', '.join(VARIANTS)}")
    p.add_argument("--compile", action="store_true", help="also run ours+compile")
    p.add_argument("--bandwidth_mb", type=int, default=512, help="buffer read to measure memory bandwidth")
    p.add_argument("--json", help="write the figures to this file")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.compile and "ours+compile" not in args.variants:
        args.variants.insert(1, "ours+compile")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if args.prompt_len + args.new_tokens > args.max_length:
        p.error(f"prompt_len + new_tokens ({args.prompt_len + args.new_tokens}) exceeds max_length {args.max_length}")
    if min(args.batch_size, args.prompt_len, args.new_tokens, args.num_beams, args.repeats) < 1 or args.warmup < 0:
        p.error("batch_size, prompt_len, new_tokens, num_beams and repeats must be >= 1, warmup >= 0")
    return args


def run(args) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = parse_dtype(args.dtype)
    folder = checkpoint_folder(args.config, dtype)
    base = Generator.from_pretrained(folder, dtype=dtype, device=args.device, cpu=CpuOptions(path=args.cpu_path))
    device = base.device
    prompts = make_prompts(base.tokenizer, args.batch_size, args.prompt_len)
    opts = build_options(max_length=args.max_length, bucket_width=args.bucket_width, max_new_tokens=args.new_tokens)
    plan = make_batch(base.tokenizer, prompts, opts, device).plan
    step_bytes = decode_bytes(base.model, args, plan)

    variants = [transformers_variant(folder, args, prompts, device) if name == "transformers"
                else ours_variant(base, name, args, prompts) for name in args.variants]
    rows, bandwidths = measure(variants, args, device)
    bandwidth = statistics.median(bandwidths)
    floor_s = step_bytes / bandwidth
    for r, v in zip(rows, variants):
        if r.decode_ms_per_token is not None:
            own = decode_bytes(v.model, args, plan) / bandwidth if v.model is not None else floor_s
            r.x_floor = r.decode_ms_per_token / (own * 1e3)  # against its own bytes (quantized: fewer)

    hf = next((r for r in rows if r.variant == "transformers" and r.ttft_ms), None)
    for r in rows:
        if hf and r is not hf and r.ttft_ms is not None:
            r.ttft_vs_hf = r.ttft_ms / hf.ttft_ms
            if r.decode_ms_per_token is not None and hf.decode_ms_per_token:
                r.decode_vs_hf = r.decode_ms_per_token / hf.decode_ms_per_token
            r.tokens_per_s_vs_hf = r.tokens_per_s / hf.tokens_per_s

    cfg = base.model.config
    weights = sum(p.numel() * p.element_size() for p in base.model.parameters())
    element = next(base.model.parameters()).element_size()
    for r in rows:
        if r.peak_mb is None:
            continue
        if r.variant == "transformers":  # its cache grows to prompt + new tokens, inside the request
            length = args.prompt_len + args.new_tokens
            r.cache_mb = (cfg.n_layer * 2 * args.batch_size * args.num_beams * cfg.n_head * length * cfg.head_dim
                          * element / 2**20)
            held = weights / 2**20 + r.cache_mb
            r.memory_ratio = (weights / 2**20 + max(r.peak_mb, r.cache_mb)) / held
        else:
            held = weights / 2**20 + r.cache_mb
            r.memory_ratio = (held + r.peak_mb) / held
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "fast_path": base.backend.fast_path,
                    "cuda": torch.cuda.get_device_name(device) if device.type == "cuda" else None},
        "command": shlex.join([Path(sys.argv[0]).name] + sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "model": {"folder": str(folder), "n_layer": cfg.n_layer, "n_head": cfg.n_head,
                  "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "weights_mb": weights / 2**20},
        "shapes": {"prompt_len": plan.prompt_len, "cache_len": plan.cache_len,
                   "windows": sorted({plan.window(s) for s in range(max(args.new_tokens - 1, 1))})},
        "floor": {"bandwidth_gb_s": bandwidth / 1e9, "bytes_per_decode_step": step_bytes, "floor_ms": floor_s * 1e3,
                  "bandwidth_per_round_gb_s": [round(b / 1e9, 2) for b in bandwidths]},
        "rows": [asdict(r) for r in rows],
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    f, m = result["floor"], result["model"]
    print(f"model {m['n_layer']} layers x {m['hidden_size']} hidden, vocab {m['vocab_size']} "
          f"({m['weights_mb']:.1f} MB of weights, {args.dtype}) on {result['machine']['device']}, "
          f"{result['machine']['threads']} threads; batch {args.batch_size}, prompt {args.prompt_len}, "
          f"new {args.new_tokens}, beams {args.num_beams}{', sampled' if args.do_sample else ''}, "
          f"max_length {args.max_length}, bucket {args.bucket_width}; "
          f"CPU fast path: {result['machine']['fast_path']}")
    print(f"floor: {f['bytes_per_decode_step'] / 2**20:.1f} MB read per decode step / "
          f"{f['bandwidth_gb_s']:.1f} GB/s measured = {f['floor_ms']:.3f} ms/token")
    rows = [Row(**r) for r in result["rows"]]
    print(markdown_table(rows) if args.markdown else table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
