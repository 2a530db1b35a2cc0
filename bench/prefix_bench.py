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
* ``server``: ``--clients`` closed-loop clients (``bench/load_client.py``, a process of its own)
  against the server, every request a shared system prompt of ``--shot_tokens`` tokens and its own
  question of ``--own_tokens``, ``--max_tokens`` greedy tokens each, streamed; the same load
  against a server without the cache and one with it; prints time to first token (p50, p90) and
  tokens/s of each, and the ratios.
* ``evict``: a pool smaller than the working set: ``--prompts`` system prompts of ``--shot_tokens``,
  each request one of them (drawn at random, seeded) and its own question, against a server whose
  pool holds ``--pool_prompts`` system prompts' blocks. The same requests under the eviction order
  before this version's (a store appended a prompt's blocks first block first, so its trunk went
  first and orphaned the rest) and under the current one; prints the hit rate (prompts that found
  blocks, and prompt tokens from the pool), blocks evicted and time to first token (p50, p90).
  One client shows the order alone: prompts arriving together on an idle engine are prefilled as a
  group, which copies nothing when one of them found nothing (one extend shape for the group).

    python bench/prefix_bench.py job --config bloom-560m --dtype fp32 --lines 32
    python bench/prefix_bench.py chat --config bloom-560m --dtype bf16 --turns 10
    python bench/prefix_bench.py server --config bloom-560m --dtype bf16 --clients 16 --shot_tokens 512 \
        --own_tokens 32 --max_tokens 32 --max_length 640
    python bench/prefix_bench.py evict --config tiny --dtype fp32 --prompts 64 --pool_prompts 16 \
        --shot_tokens 256 --own_tokens 16 --max_tokens 8 --requests 256 --clients 1 --max_length 320
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
from bloom_hpu.prefix_cache import DEFAULT_BLOCK, block_bytes  # noqa: E402
from generation.generator import DTYPES, Generator  # noqa: E402
from generation.jobs.runner import run_requests  # noqa: E402


def machine() -> str:
    name = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = open("/proc/cpuinfo").read()
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f" {f}" in flags]
    return f"{name} ({', '.join(isa)}), {torch.get_num_threads()} threads, torch {torch.__version__}"


LAMBADA = Path(__file__).resolve().parents[2] / "shared" / "data" / "lambada_test.jsonl"


def passages(count: int, offset: int = 0) -> list[str]:
    """``count`` distinct passages of real text: LAMBADA's where ../shared/data has it, else lines
    of the tiny corpus (fewer, so they repeat)."""
    if LAMBADA.exists():
        texts = [json.loads(line)["text"] for line in LAMBADA.read_text().splitlines()]
    else:
        texts = [line.strip() for line in CORPUS.read_text().splitlines() if len(line.split()) > 12]
    return [" ".join(texts[(offset + i) % len(texts)].split()) for i in range(count)]


def cut(tokenizer, text: str, tokens: int) -> str:
    return tokenizer.decode(tokenizer.encode(text)[:tokens])


def few_shot_lines(tokenizer, lines: int, shot_tokens: int, own_tokens: int) -> list[dict]:
    """Request lines sharing one k-shot block of about ``shot_tokens`` tokens, each with its own
    passage of about ``own_tokens``."""
    shots, k = "", 0
    while len(tokenizer.encode(shots)) < shot_tokens:
        text = passages(1, k)[0]
        words = text.split()
        shots += f"Passage: {' '.join(words[:-1])}\nLast word: {words[-1]}\n\n"
        k += 1
    out = []
    for i, text in enumerate(passages(lines, 1000)):
        own = cut(tokenizer, text, own_tokens)
        out.append({"prompt": f"{shots}Passage: {own}\nLast word:", "max_tokens": 1 + i % 8,
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
    # A small job first on each, untimed (two lines of another passage): kernels and caches ready.
    warm = work / "warm.jsonl"
    warm.write_text("".join(json.dumps(line | {"prompt": line["prompt"][::-1]}) + "\n" for line in lines[:2]))
    for generator in (plain, cached):
        run_requests(generator, warm, work / f"warm-{id(generator)}.jsonl", budget=args.budget, progress=False)
        if generator.runner.prefix is not None:  # what the warm-up job stored is forgotten
            from generation.run.prefix_pool import enable_prefix_cache, parse_size
            enable_prefix_cache(generator, parse_size(args.prefix_cache))
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
    from generation.chat.turns import BOT, HUMAN, Conversation, MarkerFormat

    results, computed = {}, {}
    for name, size in (("no cache", 0), ("prefix cache", args.prefix_cache)):
        generator = Generator.from_pretrained(folder, dtype=args.dtype, prefix_cache=size)
        generator.generate("warm up", max_length=args.max_length, max_new_tokens=2)  # kernels, shapes
        conversation, ttft, cpu = Conversation(MarkerFormat()), [], []
        for t, question in enumerate(passages(args.turns, 500)):
            # As the chat shell: the prompt continues the ids of the last prompt and reply.
            conversation.add(HUMAN, cut(generator.tokenizer, question, args.question))
            prompt = conversation.prompt_ids(generator.tokenizer)
            start, start_cpu = time.perf_counter(), time.process_time()
            first = generator.generate([prompt], max_length=args.max_length, max_new_tokens=1)[0]
            ttft.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
            computed.setdefault(name, []).append(len(prompt) - first.cached_tokens)
            reply = generator.generate([prompt], max_length=args.max_length, max_new_tokens=args.reply,
                                       stop=conversation.stops)[0]
            conversation.add(BOT, reply.text.strip() or "...")
            conversation.held = prompt + reply.token_ids
        results[name] = ttft
        results[f"{name}, CPU"] = cpu
    # The CPU time of the process (all its threads): on a machine shared with other work, what a
    # turn costs whatever the wait for a core; with OMP_NUM_THREADS=1, no thread spins idle in it.
    print(f"{machine()}; {args.config} {args.dtype}; {args.turns} turns, replies of {args.reply} tokens")
    print("| turn | " + " | ".join(f"TTFT ms, {n}" for n in results) + " |")
    print("| --- | " + " | ".join("---" for _ in results) + " |")
    for t in range(args.turns):
        print(f"| {t + 1} | " + " | ".join(f"{v[t] * 1000:.1f}" for v in results.values()) + " |")
    for name, v in results.items():
        print(f"{name}: last turn / first turn TTFT = {v[-1] / v[0]:.2f} (median {statistics.median(v) * 1000:.1f} ms)")
    for name, counts in computed.items():
        print(f"{name}: prompt tokens computed each turn {counts}")


def serve_engine(generator, args):
    """``generator`` behind the real app on a free loopback port, ready: (engine, server, thread, port)."""
    from bench.serve_bench import free_port, start_uvicorn
    from generation.serving.app import make_app
    from generation.serving.engine import Engine, EngineConfig

    engine = Engine(generator, EngineConfig(max_batch=args.clients, max_length=args.max_length,
                                            bucket_width=args.bucket_width, max_prefill=4, prefill_chunk=64))
    engine.start()
    engine.ready.wait()
    port = free_port()
    server, thread = start_uvicorn(make_app(engine, "bench"), port)
    return engine, server, thread, port


def run_server(args, folder: Path) -> None:
    from bench.load_client import measure
    from bench.serve_bench import percentile

    rows = []
    for name, size in (("no cache", 0), ("prefix cache", args.prefix_cache)):
        generator = Generator.from_pretrained(folder, dtype=args.dtype, prefix_cache=size)
        system = cut(generator.tokenizer, " ".join(passages(12, 0)), args.shot_tokens)
        bodies = [{"prompt": f"{system}\nQuestion: {cut(generator.tokenizer, q, args.own_tokens)}\nAnswer:",
                   "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
                  for q in passages(args.requests, 2000)]
        engine, server, thread, port = serve_engine(generator, args)
        measure(port, bodies[: args.clients], "closed", args.clients)  # first contact: untimed
        timings, wall, _ = measure(port, bodies, "closed", args.clients)
        server.should_exit = True
        thread.join(10)
        engine.stop()
        ttft = [t.chunks[0] - t.sent for t in timings if t.chunks]
        rows.append((name, percentile(ttft, 50), percentile(ttft, 90), sum(t.tokens for t in timings) / wall))
        del generator, engine
    print(f"{machine()}; {args.config} {args.dtype}; {args.clients} clients, {args.requests} requests, each a "
          f"{args.shot_tokens}-token system prompt + {args.own_tokens}-token question, {args.max_tokens} new tokens")
    print("| variant | TTFT p50 ms | TTFT p90 ms | tokens/s | TTFT p50 x no cache | tokens/s x no cache |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, p50, p90, rate in rows:
        print(f"| {name} | {p50 * 1000:.0f} | {p90 * 1000:.0f} | {rate:.1f} | {p50 / rows[0][1]:.2f} | "
              f"{rate / rows[0][3]:.2f} |")


def first_block_first(pool) -> None:
    """Give ``pool`` the store of the version before (for ``evict``'s comparison only): a prompt's
    new blocks appended to the LRU order first block first, so its trunk is its least recent block;
    eviction takes the least recent block, and a store stops where that block is its own."""

    def plan_store(ids: list[int], upto: int, namespace: str = "") -> list[tuple[int, int]]:
        placements, protected = [], set()
        for i, digest in enumerate(pool.digests(ids, namespace, upto)):
            known = pool._blocks.get(digest)
            if known is not None:
                pool._blocks.move_to_end(digest)
                protected.add(known)
                continue
            if pool._free:
                block = pool._free.pop()
            else:
                oldest_digest, block = next(iter(pool._blocks.items()))
                if block in protected:
                    break
                del pool._blocks[oldest_digest]
                pool.stats.evicted_blocks += 1
            pool._blocks[digest] = block
            protected.add(block)
            placements.append((i, block))
        pool.stats.stored_blocks += len(placements)
        return placements

    pool.plan_store = plan_store


def run_evict(args, folder: Path) -> None:
    import random

    from bench.load_client import measure
    from bench.serve_bench import percentile
    from generation.run.prefix_pool import enable_prefix_cache

    rows = []
    for name in ("first block first (before)", "deepest block first (now)"):
        generator = Generator.from_pretrained(folder, dtype=args.dtype)
        per_prompt = args.shot_tokens // DEFAULT_BLOCK * block_bytes(generator.model.config, generator.dtype)
        pool = enable_prefix_cache(generator, args.pool_prompts * per_prompt)
        if name.startswith("first"):
            first_block_first(pool)
        # Distinct from their first block on: each starts with passages of its own.
        systems = [cut(generator.tokenizer, " ".join(passages(4, 37 * i)), args.shot_tokens) for i in range(args.prompts)]
        draw = random.Random(0)
        bodies = [{"prompt": f"{draw.choice(systems)}\nQuestion: {cut(generator.tokenizer, q, args.own_tokens)}\n"
                             "Answer:", "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                   "stream_options": {"include_usage": True}}
                  for q in passages(args.requests, 2000)]
        engine, server, thread, port = serve_engine(generator, args)
        before = dict(vars(pool.stats))
        timings, wall, _ = measure(port, bodies, "closed", args.clients)
        server.should_exit = True
        thread.join(10)
        engine.stop()
        stats = {k: v - before[k] for k, v in vars(pool.stats).items() if isinstance(v, int)}
        ttft = [t.chunks[0] - t.sent for t in timings if t.chunks]
        rows.append((name, stats["hits"] / stats["lookups"], stats["cached_tokens"] / stats["looked_up_tokens"],
                     stats["evicted_blocks"], percentile(ttft, 50), percentile(ttft, 90)))
        del generator, engine
    print(f"{machine()}; {args.config} {args.dtype}; {args.requests} requests from {args.clients} clients, each one of "
          f"{args.prompts} {args.shot_tokens}-token system prompts (seeded draw) + a {args.own_tokens}-token question, "
          f"{args.max_tokens} new tokens; the pool holds {args.pool_prompts} system prompts' blocks")
    print("| eviction order | prompts that hit | prompt tokens from the pool | blocks evicted | TTFT p50 ms | "
          "TTFT p90 ms | TTFT p50 x before |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, hits, tokens, evicted, p50, p90 in rows:
        print(f"| {name} | {hits:.1%} | {tokens:.1%} | {evicted} | {p50 * 1000:.0f} | {p90 * 1000:.0f} | "
              f"{p50 / rows[0][4]:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=["job", "chat", "server", "evict"])
    p.add_argument("--config", default="bloom-560m", help="tiny, bloom-560m, ... or a checkpoint folder")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    p.add_argument("--prefix_cache", default="1GB")
    p.add_argument("--lines", type=int, default=32)
    p.add_argument("--shot_tokens", type=int, default=560)
    p.add_argument("--own_tokens", type=int, default=110)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply", type=int, default=24)
    p.add_argument("--question", type=int, default=40, help="chat: tokens of each user message")
    p.add_argument("--max_length", type=int, default=1024)
    p.add_argument("--clients", type=int, default=16, help="server: closed-loop clients (and --max_batch)")
    p.add_argument("--requests", type=int, default=48, help="server: requests in all")
    p.add_argument("--max_tokens", type=int, default=32, help="server: new tokens per request")
    p.add_argument("--bucket_width", type=int, default=64, help="server: length buckets")
    p.add_argument("--prompts", type=int, default=64, help="evict: distinct system prompts")
    p.add_argument("--pool_prompts", type=int, default=16, help="evict: system prompts the pool holds")
    args = p.parse_args()
    folder = checkpoint_folder(args.config, DTYPES[args.dtype])
    {"job": run_job, "chat": run_chat, "server": run_server, "evict": run_evict}[args.scenario](args, folder)


if __name__ == "__main__":
    main()
