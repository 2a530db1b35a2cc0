#!/usr/bin/env python3
"""The prefix cache against no cache, side by side in one process, on the same weights.

* ``job``: a few-shot request file (``docs/batch-jobs.md``'s format, as evaluation harnesses write
  it): every line carries the same k worked examples (about 80% of its tokens) and ends with its
  own question, asking for 1-8 greedy tokens with log-probs. Run through the batch runner
  (``run_requests``) without the cache, then with a fresh one; prints requests/s of each, the
  ratio, and checks that both wrote the same answers (tokens, text, log-probs within 1e-4).
* ``chat``: a conversation of ``--turns`` turns through the chat shell's prompt format, each reply
  ``--reply`` tokens; prints each turn's time to first token with and without the cache, and the
  last turn's against the first.

    python bench/prefix_bench.py job --config bloom-560m --dtype fp32 --lines 32
    python bench/prefix_bench.py chat --config bloom-560m --dtype bf16 --turns 10
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.generate_bench import CORPUS, checkpoint_folder  # noqa: E402
from generation.generator import DTYPES, Generator  # noqa: E402
from generation.jobs.runner import run_requests  # noqa: E402


def machine() -> str:
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"{name} ({', '.join(isa)}), {torch.get_num_threads()} threads, torch {torch.__version__}"


def sentences(count: int, offset: int = 0) -> list[str]:
    lines = [line.strip() for line in CORPUS.read_text().splitlines() if len(line.split()) > 12]
    return [lines[(offset + i) % len(lines)] for i in range(count)]


def few_shot_lines(tokenizer, lines: int, shot_tokens: int, own_tokens: int) -> list[dict]:
    """Request lines sharing one k-shot block of about ``shot_tokens`` tokens, each with its own
    question of about ``own_tokens``."""
    shots, k = "", 0
    while len(tokenizer.encode(shots)) < shot_tokens:
        a, b = sentences(2, 2 * k)
        shots += f"Passage: {a}\nNext: {' '.join(b.split()[:6])}\n\n"
        k += 1
    out = []
    for i in range(lines):
        own = ""
        for s in sentences(4, 1000 + 4 * i):
            if len(tokenizer.encode(own)) >= own_tokens:
                break
            own += s + " "
        out.append({"prompt": f"{shots}Passage: {own.strip()}\nNext:", "max_tokens": 1 + i % 8,
                    "temperature": 0, "logprobs": 1 + i % 5})
    return out


def answers(path: Path) -> list[dict]:
    return [json.loads(line)["result"]["choices"] for line in path.read_text().splitlines()]


def same(a: list[dict], b: list[dict]) -> bool:
    for x, y in zip(a, b):
        for cx, cy in zip(x, y):
            if cx["text"] != cy["text"]:
                return False
            lx, ly = cx["logprobs"]["token_logprobs"], cy["logprobs"]["token_logprobs"]
            if any(abs(p - q) > 1e-4 for p, q in zip(lx, ly)):
                return False
    return len(a) == len(b)


def run_job(args, folder: Path) -> None:
    plain = Generator.from_pretrained(folder, dtype=args.dtype)
    cached = Generator.from_pretrained(folder, dtype=args.dtype, prefix_cache=args.prefix_cache)
    lines = few_shot_lines(plain.tokenizer, args.lines, args.shot_tokens, args.own_tokens)
    lengths = [len(plain.tokenizer.encode(line["prompt"])) for line in lines]
    work = Path(tempfile.mkdtemp())
    requests = work / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # One small job first on each, untimed: the kernels, caches and shapes of both are ready.
    for generator in (plain, cached):
        run_requests(generator, requests, work / f"warm-{id(generator)}.jsonl", budget=args.budget, progress=False)
        if generator.runner.prefix is not None:  # what the warm-up job stored is forgotten
            from generation.prefix import enable_prefix_cache
            enable_prefix_cache(generator, args.prefix_cache)
    times, outputs = {}, {}
    for name, generator in (("no cache", plain), ("prefix cache", cached)):
        out = work / f"{name.replace(' ', '-')}.jsonl"
        start = time.perf_counter()
        summary = run_requests(generator, requests, out, budget=args.budget, progress=False)
        times[name] = time.perf_counter() - start
        outputs[name] = answers(out)
        assert summary.answered == len(lines), summary
    pool = cached.runner.prefix.stats
    print(f"{machine()}; {args.config} {args.dtype}; {len(lines)} lines of {min(lengths)}-{max(lengths)} tokens "
          f"(shared block {args.shot_tokens}), budget {args.budget}")
    print("| variant | seconds | requests/s | x no cache |")
    print("| --- | --- | --- | --- |")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.2f} | {len(lines) / seconds:.3f} | {times['no cache'] / seconds:.2f} |")
    print(f"prompt tokens from the pool: {pool.cached_tokens} of {pool.looked_up_tokens}; "
          f"same answers: {same(outputs['no cache'], outputs['prefix cache'])}")


def run_chat(args, folder: Path) -> None:
    from generation.chat.turns import BOT, HUMAN, MarkerFormat, Turn

    fmt = MarkerFormat()
    results = {}
    for name, size in (("no cache", 0), ("prefix cache", args.prefix_cache)):
        generator = Generator.from_pretrained(folder, dtype=args.dtype, prefix_cache=size)
        generator.generate("warm up", max_length=args.max_length, max_new_tokens=2)  # kernels, shapes
        turns, ttft = [], []
        for t, question in enumerate(sentences(args.turns, 500)):
            turns.append(Turn(HUMAN, question))
            prompt = fmt.render(turns, open_reply=True)
            start = time.perf_counter()
            generator.generate(prompt, max_length=args.max_length, max_new_tokens=1)
            ttft.append(time.perf_counter() - start)
            reply = generator.generate(prompt, max_length=args.max_length, max_new_tokens=args.reply,
                                       stop=fmt.stops)[0].text
            turns.append(Turn(BOT, reply.strip() or "..."))
        results[name] = ttft
    print(f"{machine()}; {args.config} {args.dtype}; {args.turns} turns, replies of {args.reply} tokens")
    print("| turn | " + " | ".join(f"TTFT ms, {n}" for n in results) + " |")
    print("| --- | " + " | ".join("---" for _ in results) + " |")
    for t in range(args.turns):
        print(f"| {t + 1} | " + " | ".join(f"{v[t] * 1000:.1f}" for v in results.values()) + " |")
    for name, v in results.items():
        print(f"{name}: last turn / first turn TTFT = {v[-1] / v[0]:.2f} (median {statistics.median(v) * 1000:.1f} ms)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["job", "chat"])
    p.add_argument("--config", default="bloom-560m", help="tiny, bloom-560m, ... or a checkpoint folder")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--prefix_cache", default="1GB")
    p.add_argument("--lines", type=int, default=32)
    p.add_argument("--shot_tokens", type=int, default=560)
    p.add_argument("--own_tokens", type=int, default=110)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply", type=int, default=24)
    p.add_argument("--max_length", type=int, default=1024)
    args = p.parse_args()
    folder = checkpoint_folder(args.config, DTYPES[args.dtype])
    (run_job if args.scenario == "job" else run_chat)(args, folder)


if __name__ == "__main__":
    main()
