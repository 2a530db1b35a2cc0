#!/usr/bin/env python3
"""Serving benchmark: our server against a one-request-at-a-time transformers server and against
the same requests as one offline ``--requests`` job, side by side on the same weights.

* ``ours``          the continuous-batching engine behind the HTTP app (``generation/serving/``),
                    warmed up before the first request
* ``transformers``  what a user would write: ``BloomForCausalLM.generate`` behind the same HTTP
                    surface, one request at a time (a lock), streaming one chunk per token
* ``offline``       the same requests as one batch job (``jobs.runner.run_requests``): throughput
                    only, no latencies (nothing streams)
* ``ours+ngram:K``  ours with speculative decoding (``--serve --speculate ngram:K``); its ratios
                    line gives its tokens/s and p99 inter-token latency over ours' at each level,
                    and the guesses its verify passes accepted
* ``ours+draft:K``  the same with a draft model (``--speculate draft:K --draft_model DIR``): the
                    target's first ``--draft_layers`` blocks (``utils/first_layers.py``). Random
                    weights make such a draft disagree; ``--agreeing_target`` runs every variant on a
                    copy of the target whose later blocks add nothing (``speculate_bench.py``'s
                    ``agreeing_target``: the same cost a token), so the draft agrees by construction

Load: closed loop (``--clients``: each client sends its next request when the last one ended) and
open loop (``--rates``: Poisson arrivals at these requests/s), prompts of mixed lengths, greedy
(or sampled at ``--temperature``, each request with its own seed), ``--max_tokens`` each, sent by
clients in a process of their own (``bench/load_client.py``). Every request streams; time to
first token is from sending to the first chunk with text, tokens the server's usage count.
Inter-token latency is per token: a chunk that brings k tokens (its text held back for a step or
more: an incomplete UTF-8 character, a possible stop string; the server's
``continuous_usage_stats`` counts them) after a gap g counts as k gaps of g / k. The gaps between
chunks as they are ("chunk gap") are printed too.
For ours it also prints the step shapes the load added after warm-up (should be 0), and times the
yardstick of each level's latency targets, the engine's plain decode step of the rows the level
runs (a closed loop: min(clients, max_batch) rows; an open loop: one), right before and right after
the level: a CPU's speed can drift from one minute to the next, so the yardstick is the mean of the
two, and both are printed.

    python bench/serve_bench.py --config tiny --clients 1,4,16,32 --requests 64
    python bench/serve_bench.py --config tiny --clients 16 --requests 64 --variants ours,ours+ngram:4
    OMP_NUM_THREADS=2 python bench/serve_bench.py --config bloom-560m --dtype bf16 --agreeing_target --clients 1,16 \
        --requests 16 --max_tokens 32 --prompt_len 8,96 --max_length 160 --variants ours,ours+draft:4,ours+ngram:4
    OMP_NUM_THREADS=2 python bench/serve_bench.py --config bloom-560m --dtype bf16 --clients 1,4,16 \\
        --requests 48 --max_tokens 32 --prompt_len 8,96 --max_length 160
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from math import nan
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from fastapi import Request  # noqa: E402  (module level: the baseline's handler annotates with it)

from bench.generate_bench import checkpoint_folder  # noqa: E402
from bench.load_client import Timing, measure, stream_request  # noqa: E402

WORDS = ("the of and a to in is was it for on with as his that by at from her he said they an be this which "
         "or had not but what all were when we there can more if no out so up into time only new some").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_prompts(tokenizer, count: int, low: int, high: int, seed: int) -> list[str]:
    """Prompts of random words, each cut to a token length drawn in [low, high]."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        want = rng.randint(low, high)
        ids = tokenizer.encode(" ".join(rng.choice(WORDS) for _ in range(want * 2)))[:want]
        prompts.append(tokenizer.decode(ids))
    return prompts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def summarize(variant: str, load: str, timings: list[Timing], wall: float, new_shapes="",
              server_cpu: float = nan, client_cpu: float = nan) -> dict:
    """One row of the table; ``server_cpu`` and ``client_cpu`` are CPU seconds over ``wall``."""
    tokens = sum(t.tokens for t in timings)
    ttft = [(t.chunks[0] - t.sent) * 1e3 for t in timings if t.chunks]
    gaps = [(b - a) * 1e3 for t in timings for a, b in zip(t.chunks, t.chunks[1:])]
    itl = [g for t in timings for g in per_token_gaps(t)]
    return {"variant": variant, "load": load, "requests": len(timings), "tokens": tokens,
            "tok_s": tokens / wall, "req_s": len(timings) / wall,
            "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": percentile(itl, 50), "itl_p99": percentile(itl, 99), "gap_p99": percentile(gaps, 99),
            "server_cores": server_cpu / wall, "client_cores": client_cpu / wall, "new_shapes": new_shapes}


def per_token_gaps(timing: Timing) -> list[float]:
    """ms between a request's tokens: each gap between two chunks with text, split evenly over the
    tokens the later chunk brings (one each where the server does not count them)."""
    counted = len(timing.chunk_tokens) == len(timing.chunks)
    out = []
    for i in range(1, len(timing.chunks)):
        brought = timing.chunk_tokens[i] - timing.chunk_tokens[i - 1] if counted else 1
        brought = max(brought, 1)
        out += [(timing.chunks[i] - timing.chunks[i - 1]) * 1e3 / brought] * brought
    return out


# --- the servers ----------------------------------------------------------------------------------


def start_uvicorn(app, port: int):
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return server, thread


def engine_config(args, speculate: str | None = None):
    from generation.search.guesses import parse_speculation
    from generation.serving.engine import EngineConfig

    return EngineConfig(max_batch=args.max_batch, max_length=args.max_length, bucket_width=args.bucket_width,
                        max_prefill=args.max_prefill, prefill_chunk=args.prefill_chunk,
                        burst_wait_ms=args.burst_wait_ms, speculation=parse_speculation(speculate))


def ours(generator, args, device_rows=None, speculate: str | None = None, engine_out: list | None = None):
    """Our engine behind the HTTP app on a free port, warmed up: (port, stop). ``device_rows``:
    the engine's rows (tensor parallelism: rank 0's ``LeaderRows``; default: its own);
    ``speculate``: "ngram:K" or None; ``engine_out``: a list the engine is appended to."""
    from generation.serving.app import make_app
    from generation.serving.engine import Engine

    engine = Engine(generator, engine_config(args, speculate), device_rows=device_rows)
    if engine_out is not None:
        engine_out.append(engine)
    engine.start()
    engine.ready.wait()
    port = free_port()
    server, thread = start_uvicorn(make_app(engine, "bench"), port)
    return port, lambda: (setattr(server, "should_exit", True), thread.join(10), engine.stop())


def transformers_app(folder: Path, dtype: torch.dtype, device: str):
    """One request at a time through ``generate``, streamed one chunk per token."""
    import asyncio

    import transformers
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from transformers.generation.streamers import BaseStreamer

    transformers.logging.set_verbosity_error()
    model = transformers.BloomForCausalLM.from_pretrained(folder, torch_dtype=dtype).to(device).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    lock = threading.Lock()
    app = FastAPI()

    class Tokens(BaseStreamer):
        def __init__(self, emit):
            self.emit, self.first = emit, True

        def put(self, value):
            if self.first:  # generate hands the prompt over first
                self.first = False
                return
            self.emit(tokenizer.decode(value.reshape(-1).tolist()))

        def end(self):
            self.emit(None)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = json.loads(await request.body())
        loop, pieces = asyncio.get_running_loop(), asyncio.Queue()
        emit = lambda x: loop.call_soon_threadsafe(pieces.put_nowait, x)  # noqa: E731
        ids = tokenizer(body["prompt"], return_tensors="pt").input_ids.to(device)

        def work():
            sample = dict(do_sample=True, temperature=body["temperature"], top_k=None) if body["temperature"] else \
                dict(do_sample=False)
            with lock, torch.no_grad():
                model.generate(ids, max_new_tokens=body["max_tokens"], streamer=Tokens(emit),
                               pad_token_id=tokenizer.pad_token_id, **sample)

        threading.Thread(target=work, daemon=True).start()

        async def events():
            count = 0
            while (piece := await pieces.get()) is not None:
                count += 1
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': piece or ' '}]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': {'completion_tokens': count}})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def baseline(folder, dtype, device):
    port = free_port()
    server, thread = start_uvicorn(transformers_app(folder, dtype, device), port)
    return port, lambda: (setattr(server, "should_exit", True), thread.join(10))


def offline_run(generator, bodies: list[dict], budget: int) -> dict:
    from generation.jobs.runner import run_requests

    with tempfile.TemporaryDirectory() as tmp:
        requests, results = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        requests.write_text("".join(json.dumps(b) + "\n" for b in bodies))
        start = time.perf_counter()
        run_requests(generator, requests, results, budget=budget, progress=False)
        wall = time.perf_counter() - start
        tokens = sum(json.loads(line)["result"]["usage"]["completion_tokens"] for line in results.read_text().splitlines())
    return {"variant": "offline", "load": "one job", "requests": len(bodies), "tokens": tokens, "tok_s": tokens / wall,
            "req_s": len(bodies) / wall, "ttft_p50": nan, "ttft_p99": nan, "itl_p50": nan, "itl_p99": nan,
            "new_shapes": ""}


def decode_ms(generator, args, rows: int, prompt_tokens: int) -> float:
    """The engine's decode step of ``rows`` running rows (their batch bucket, the window of a typical
    row, no prompt chunk in it), timed alone: the yardstick of the inter-token latency targets."""
    from generation.serving.device_rows import DeviceRows, batch_buckets

    bucket = next(b for b in batch_buckets(args.max_batch) if b >= rows)
    device_rows = DeviceRows(generator, bucket, args.max_length, args.bucket_width, 1, args.prefill_chunk)
    window = device_rows.length_bucket(min(args.max_length, prompt_tokens + args.max_tokens))
    for _ in range(3):
        device_rows.decode(bucket, [5] * bucket, [prompt_tokens] * bucket, window)
    times = []
    for i in range(20):
        start = time.perf_counter()
        device_rows.decode(bucket, [5] * bucket, [prompt_tokens + i % args.max_tokens] * bucket, window)
        generator.backend.synchronize()  # a card runs the step asynchronously
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ratios(rows: list[dict]) -> str:
    """The issue's targets, per level of ours: ours / transformers and ours / offline throughput;
    ours' inter-token latency p99 and p50 / the decode step of as many running rows (the row's
    ``decode_step_ms``: the mean of its timings before and after the level)."""
    by = {(r["variant"], r["load"]): r for r in rows}
    offline = by.get(("offline", "one job"))
    lines = []
    for (variant, load), r in by.items():
        if variant.startswith("ours+") and ("ours", load) in by:  # speculation against ours, at the same level
            plain = by[("ours", load)]
            lines.append(f"{variant} at {load}: {r['tok_s'] / plain['tok_s']:.2f}x ours' tokens/s, p99 inter-token "
                         f"{r['itl_p99'] / plain['itl_p99']:.2f}x ours', {r['accepted']} of {r['offered']} guesses "
                         f"accepted in {r['verify_passes']} verify passes")
        if variant != "ours":
            continue
        parts = [f"ours at {load}:"]
        if ("transformers", load) in by:
            parts.append(f"{r['tok_s'] / by[('transformers', load)]['tok_s']:.2f}x transformers")
        if offline:
            parts.append(f"{r['tok_s'] / offline['tok_s']:.2f}x offline")
        step, (before, after) = r["decode_step_ms"], r["decode_step_timed"]
        parts.append(f"p99 inter-token {r['itl_p99'] / step:.2f}x / p50 {r['itl_p50'] / step:.2f}x "
                     f"the {r['decode_step_rows']}-row decode step ({step:.1f} ms: {before:.1f} before, "
                     f"{after:.1f} after)")
        lines.append(" ".join(parts[:1]) + " " + ", ".join(parts[1:]))
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    head = f"{'variant':<13} {'load':<11} {'req':>4} {'tokens':>6} {'tok/s':>8} {'req/s':>7} " \
           f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'gap p99':>8} {'cores':>9} {'new shapes':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['variant']:<13} {r['load']:<11} {r['requests']:>4} {r['tokens']:>6} {r['tok_s']:>8.1f} "
                     f"{r['req_s']:>7.2f} {r['ttft_p50']:>9.1f} {r['ttft_p99']:>9.1f} {r['itl_p50']:>8.2f} "
                     f"{r['itl_p99']:>8.2f} {r.get('gap_p99', nan):>8.2f} {cores(r):>9} {str(r['new_shapes']):>10}")
    return "\n".join(lines) + "\n(times in ms; cores: the CPU the server's process and the clients' used, in cores)"


def cores(row: dict) -> str:
    server, client = row.get("server_cores", nan), row.get("client_cores", nan)
    return "" if math.isnan(server) else f"{server:.2f}+{client:.2f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny", help="tiny, a model shape of bench/generate_bench.py, or a checkpoint folder")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda: where every variant runs")
    p.add_argument("--max_length", type=int, default=128)
    p.add_argument("--max_batch", type=int, default=32)
    p.add_argument("--bucket_width", type=int, default=32)
    p.add_argument("--max_prefill", type=int, default=4, help="ours: prompts prefilled together (when idle)")
    p.add_argument("--prefill_chunk", type=int, default=64, help="ours: prompt tokens per decode step")
    p.add_argument("--burst_wait_ms", type=float, default=8.0, help="ours: an idle engine gathers a burst (0: off)")
    p.add_argument("--clients", default="1,4,16,32", help="closed-loop client counts")
    p.add_argument("--rates", default="", help="open-loop Poisson rates, requests/s (e.g. 2,8)")
    p.add_argument("--requests", type=int, default=64, help="requests per load level")
    p.add_argument("--prompt_len", default="8,64", help="prompt tokens: low,high")
    p.add_argument("--max_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="every request's (0: greedy; > 0: sampled, seeded)")
    p.add_argument("--variants", default="ours,transformers,offline")
    p.add_argument("--draft_layers", type=int, default=4, help="ours+draft:K: blocks of the target's that make "
                   "the draft model")
    p.add_argument("--agreeing_target", action="store_true", help="run every variant on a copy of the target whose "
                   "blocks past --draft_layers add nothing: the first-blocks draft agrees with it by construction")
    p.add_argument("--budget", type=int, default=8192, help="offline: tokens per batch (as --requests)")
    p.add_argument("--threads", type=int, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the rows here")
    return p.parse_args(argv)


def draft_model(folder: Path, args):
    """A draft of the target's first ``--draft_layers`` blocks, loaded beside it (written once per run)."""
    from generation import Generator
    from generation.search.draft import DraftModel
    from utils.first_layers import first_layers

    path = first_layers(Path(folder), Path(tempfile.mkdtemp(prefix="serve_bench_draft_")) / "draft", args.draft_layers)
    return DraftModel(Generator.from_pretrained(path, dtype=args.dtype, device=args.device).runner, path)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from generation import Generator

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    folder = checkpoint_folder(args.config, dtype)
    if args.agreeing_target:
        from bench.speculate_bench import agreeing_target

        folder = agreeing_target(Path(folder), Path(tempfile.mkdtemp(prefix="serve_bench_target_")) / "agreeing",
                                 args.draft_layers)
    generator = Generator.from_pretrained(folder, dtype=args.dtype, device=args.device)
    low, high = (int(x) for x in args.prompt_len.split(","))
    high = min(high, args.max_length - args.max_tokens)
    prompts = make_prompts(generator.tokenizer, args.requests, low, high, args.seed)
    mean_prompt = round(statistics.mean(len(generator.tokenizer.encode(p)) for p in prompts))
    bodies = [{"prompt": p, "max_tokens": args.max_tokens, "temperature": args.temperature}
              | ({"seed": args.seed + i} if args.temperature else {}) for i, p in enumerate(prompts)]
    loads = [("closed", int(c)) for c in args.clients.split(",") if c] + \
            [("open", float(r)) for r in args.rates.split(",") if r]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    rows = []
    for variant in variants:
        if variant == "offline":
            rows.append(offline_run(generator, bodies, args.budget))
            continue
        engines = []
        if variant.startswith("ours+draft"):
            generator.draft = draft_model(folder, args)
        if variant == "ours" or variant.startswith("ours+"):
            port, stop = ours(generator, args, speculate=variant.partition("+")[2] or None, engine_out=engines)
        elif variant == "transformers":
            port, stop = baseline(folder, dtype, args.device)
        else:
            raise SystemExit(f"error: unknown variant {variant!r}")
        try:
            stream_request(port, bodies[0])  # one untimed request: connections, allocator
            for kind, level in loads:
                running = min(int(level), args.max_batch) if kind == "closed" else 1
                if variant == "ours":
                    before = decode_ms(generator, args, running, mean_prompt)
                shapes_before = generator.backend.graph_count()
                speculated = dict(engines[0].stats) if engines else {}
                server_cpu = time.process_time()
                timings, wall, client_cpu = measure(port, bodies, kind, level, args.seed)
                server_cpu = time.process_time() - server_cpu
                name = f"{level} clients" if kind == "closed" else f"{level:g} req/s"
                new = generator.backend.graph_count() - shapes_before if engines else ""
                rows.append(summarize(variant, name, timings, wall, new, server_cpu, client_cpu))
                if engines:
                    rows[-1].update({key: engines[0].stats[name] - speculated[name] for key, name in
                                     (("verify_passes", "verify_passes"), ("offered", "guesses_offered"),
                                      ("accepted", "guesses_accepted"))})
                if variant == "ours":
                    after = decode_ms(generator, args, running, mean_prompt)
                    rows[-1].update(decode_step_rows=running, decode_step_timed=(before, after),
                                    decode_step_ms=(before + after) / 2)
                print(table(rows[-1:]).splitlines()[2], flush=True)
        finally:
            stop()
            generator.draft = None
    print(table(rows))
    print(ratios(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
