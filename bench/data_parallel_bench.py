#!/usr/bin/env python3
"""Data parallelism: D replicas against one process (``--data_parallel``), request files and the server.

Modes (``--mode``, default all of them, in one run):

1. ``split``: one process answers every planned batch of a request file of lines of mixed length
   (64 by default, written here) and times each one; the bench then splits those batches over D
   replicas three ways: the queue ``generation/jobs/data_parallel.py`` runs (``WorkQueue``: the
   costliest first, each to the replica free first, by the measured times), its fallback without
   a store (``deal``: the costliest first, to the replica with the least rows x static length so
   far) and the plain way (``deal_in_turn``: batch i to replica i mod D), and prints each split's
   makespan (the slowest replica's measured seconds) against the ideal (total / D). Only the
   assignment is computed, so the figure says how even each split is, not how fast two processes
   run side by side.
2. ``requests``: ``bloom.py --requests`` as one 1-thread process, then under ``torchrun
   --nproc_per_node D --data_parallel D`` (1 thread per rank), alternating ``--rounds`` times;
   lines/s of each (median), their ratio, and whether the results files are the same but for
   timings.
3. ``ceiling``: D independent one-process jobs (1 thread each) on the whole file at once against
   one alone: what the machine itself allows D processes (they share its memory bandwidth,
   caches and clocks), the bound for ``requests``.
4. ``nodes``: the same job as D "nodes" on loopback, one ``torchrun --nnodes D --node_rank k``
   launcher per node, one rank each, against one process.
5. ``serve``: ``--clients`` clients (16) each send ``--per_client`` greedy completions of
   ``--max_tokens`` tokens, every prompt a shared system prompt (or one of ``--system_prompts``)
   and a question of its own, to one
   server, then to D replicas behind the front door (``--serve --data_parallel D``; ``--tp T``
   ranks each, against one replica of T ranks): tokens/s of each and their ratio, the prefix
   cache's hit rate (hits / lookups) of the one replica and of each of the D, where the front door
   routed, and whether the answers are the same.

On a shared machine the ratios move with everyone else's load: the bench prints ``uptime`` with them.

    python bench/data_parallel_bench.py --weights checkpoints/bloom-tiny [--mode serve] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def write_requests(path: Path, lines: int) -> None:
    """Prompts of 1 to 96 words and 4 to 32 new tokens, in no order of length."""
    out = []
    for i in range(lines):
        words = 1 + (i * 37) % 96
        out.append({"prompt": " ".join(WORDS[(i * j + j) % len(WORDS)] for j in range(words)),
                    "max_tokens": 4 + (i * 11) % 29, "temperature": 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in out))


def measure_split(weights: str, requests: Path, budget: int, replicas: int) -> None:
    import torch

    from generation.generator import Generator
    from generation.jobs.data_parallel import batch_cost, deal, deal_in_turn
    from generation.jobs.grouping import plan_batches
    from generation.jobs.runner import answer_or_split, read_requests

    torch.set_num_threads(1)
    generator = Generator.from_pretrained(weights, device="cpu", prefix_cache=0)
    items, _ = read_requests(requests)
    lengths = {r.line: [len(ids) for ids in generator.tokenizer.encode_batch(r.prompts)] for r in items}
    batches = plan_batches(items, lengths, budget)
    answer_or_split(generator, batches[0])  # first-time costs out of the timing
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        answer_or_split(generator, batch)
        seconds.append(time.perf_counter() - start)
    ideal = sum(seconds) / replicas
    print(f"split: {len(batches)} batches, {sum(seconds):.2f} s in one process; ideal per replica {ideal:.2f} s")
    costs = [batch_cost(b) for b in batches]
    for name, shares in (("queue (costliest first)", queue_shares(seconds, costs, replicas)),
                         ("deal (costliest first)", deal(costs, replicas)),
                         ("in turn (i mod D)", deal_in_turn(len(batches), replicas))):
        loads = [sum(seconds[i] for i in share) for share in shares]
        print(f"  {name:24s} replicas {', '.join(f'{x:.2f}' for x in loads)} s; "
              f"makespan {max(loads):.2f} s = {max(loads) / ideal:.3f} x ideal")


def queue_shares(seconds: list[float], costs: list[float], replicas: int) -> list[list[int]]:
    """What ``WorkQueue`` gives each replica when batch i takes seconds[i]: the batches in order of
    cost, each to the replica that is free first (ties: the lowest replica)."""
    free_at, shares = [0.0] * replicas, [[] for _ in range(replicas)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        g = min(range(replicas), key=lambda g: (free_at[g], g))
        shares[g].append(i)
        free_at[g] += seconds[i]
    return shares


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def launcher(ranks: int) -> list[str]:
    """The command prefix that starts ``ranks`` ranks on this machine (none for one)."""
    if ranks == 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port",
            str(free_port())]


def job_seconds(stderr: str) -> float:
    """The job's own figure (rank 0's summary: reading, planning, answering, joining), not the start-up."""
    summary = [line for line in stderr.splitlines() if "requests answered" in line][-1]
    return float(summary.rsplit(" in ", 1)[1].split(" s")[0])


def run_job(weights: str, requests: Path, results: Path, budget: int, replicas: int, nodes: bool = False) -> float:
    """Seconds of one request job: one process, D ranks under one launcher, or D loopback "nodes"."""
    results.unlink(missing_ok=True)
    args = [str(ROOT / "bloom.py"), "--weights", weights, "--requests", str(requests), "--results", str(results),
            "--budget", str(budget), "--prefix_cache", "0", "--quiet", "--data_parallel", str(replicas)]
    if not nodes:
        done = subprocess.run(launcher(replicas) + args, env=ENV, capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        return job_seconds(done.stderr)
    master = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(replicas), "--node_rank",
                               str(k), "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", master,
                               *args], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for k in range(replicas)]
    errs = [proc.communicate()[1] for proc in procs]
    if any(proc.returncode for proc in procs):
        sys.exit("\n".join(err[-2000:] for err in errs))
    return job_seconds(errs[0])


def without_timings(path: Path) -> list[str]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["result"].pop("request_time")
    return [json.dumps(r) for r in records]


def machine_ceiling(args, requests: Path, tmp: Path) -> None:
    """What the machine allows D processes at once: D independent one-process jobs (1 thread each)
    on the whole file at the same time, against one alone. Nothing is shared but the machine (its
    memory bandwidth, caches, clocks), so their lines/s over one's is the most D replicas can reach."""
    alone, together = [], []
    for _ in range(args.rounds):
        alone.append(run_job(args.weights, requests, tmp / "alone.jsonl", args.budget, 1))
        with ThreadPoolExecutor(args.replicas) as pool:
            together.append(max(pool.map(lambda g: run_job(args.weights, requests, tmp / f"copy{g}.jsonl",
                                                           args.budget, 1), range(args.replicas))))
    one, many = statistics.median(alone), statistics.median(together)
    print(f"ceiling, {args.lines} lines: one process alone {one:.2f} s; {args.replicas} independent processes at "
          f"once, each the whole file, {many:.2f} s: the machine allows {args.replicas * one / many:.2f}x")


def compare_jobs(args, requests: Path, tmp: Path, nodes: bool) -> None:
    one_s, many_s = [], []
    for _ in range(args.rounds):
        one_s.append(run_job(args.weights, requests, tmp / "one.jsonl", args.budget, 1))
        many_s.append(run_job(args.weights, requests, tmp / "many.jsonl", args.budget, args.replicas, nodes))
    one, many = statistics.median(one_s), statistics.median(many_s)
    same = without_timings(tmp / "one.jsonl") == without_timings(tmp / "many.jsonl")
    how = f"{args.replicas} loopback nodes" if nodes else f"D={args.replicas}"
    print(f"{'nodes' if nodes else 'requests'}, {args.lines} lines: one process {args.lines / one:.1f} lines/s "
          f"({one:.2f} s), {how} {args.lines / many:.1f} lines/s ({many:.2f} s): {one / many:.2f}x; "
          f"results the same but for timings: {same}")


# --- the server ---------------------------------------------------------------------------------

SYSTEM = ("You are the support desk of a small shipping company. Answer each customer's question in one or two "
          "plain sentences, give the tracking steps when asked, never invent a date, and do not repeat the question. ")
TOPICS = ["my parcel", "the invoice", "a refund", "the driver", "my address", "a damaged box", "the customs form",
          "a late delivery"]


COMPANIES = ["a small shipping company", "a city library", "a bicycle repair shop", "a regional bank",
             "a bakery chain", "a hotel", "a software vendor", "a train operator"]


def system_prompt(client: int, prompts: int) -> str:
    """Client c's system prompt: with ``prompts`` > 1, one of that many (clients c, c + prompts, ...
    share one), each the support desk of another business."""
    if prompts == 1:
        return SYSTEM
    return SYSTEM.replace("a small shipping company", COMPANIES[client % prompts % len(COMPANIES)])


def question(client: int, k: int) -> str:
    return f"Customer {client}, message {k}: what should I do about {TOPICS[(client + k) % len(TOPICS)]}?"


def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""
    except OSError:
        return 0, ""


def start_server(args, replicas: int, log: Path) -> tuple[subprocess.Popen, int]:
    """``bloom.py --serve``: one replica of ``--tp`` ranks, or ``replicas`` of them; back once healthy."""
    port = free_port()
    command = launcher(replicas * args.tp) + [
        str(ROOT / "bloom.py"), "--weights", args.weights, "--serve", "--port", str(port), "--max_batch",
        str(args.max_batch), "--max_length", str(args.max_length), "--data_parallel", str(replicas)]
    proc = subprocess.Popen(command, env=ENV, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 900
    while get(port, "/health", 2.0)[0] != 200:
        if proc.poll() is not None or time.time() > deadline:
            stop_server(proc)
            sys.exit(f"the server did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    return proc, port


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def load(port: int, args) -> tuple[float, int, list[str]]:
    """Every client's requests, the clients at once: (seconds, tokens generated, the answers in order)."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=1800)
    model = json.loads(get(port, "/v1/models")[1])["data"][0]["id"]

    def one_client(c: int) -> list[tuple[str, int]]:
        out = []
        for k in range(args.per_client):
            answer = client.completions.create(model=model, prompt=system_prompt(c, args.system_prompts) + question(c, k), max_tokens=args.max_tokens,
                                               temperature=0, extra_body={"ignore_eos": True})
            out.append((answer.choices[0].text, answer.usage.completion_tokens))
        return out

    start = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        done = [pair for answers in pool.map(one_client, range(args.clients)) for pair in answers]
    return time.perf_counter() - start, sum(tokens for _, tokens in done), [text for text, _ in done]


def scrape(port: int) -> dict[tuple, float]:
    """/metrics: (sample name, its replica label or None) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(get(port, "/metrics")[1]):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("replica"), sample.labels.get("reason"))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def hit_rate(samples: dict, replica: str | None) -> str:
    hits = samples.get(("bloom_prefix_cache_hits", replica, None), 0)
    lookups = samples.get(("bloom_prefix_cache_lookups", replica, None), 0)
    return f"{hits:.0f}/{lookups:.0f} ({hits / lookups if lookups else 0:.2f})"


def compare_servers(args, tmp: Path) -> None:
    """``--rounds`` rounds, each one replica then D (the order turned every round); each round's
    figures, then the medians of tokens/s and their ratio."""
    speeds = {1: [], args.replicas: []}
    for r in range(args.rounds):
        runs = {}
        for replicas in ((1, args.replicas) if r % 2 == 0 else (args.replicas, 1)):
            proc, port = start_server(args, replicas, tmp / f"serve{replicas}.log")
            try:
                seconds, tokens, answers = load(port, args)
                runs[replicas] = (tokens / seconds, answers, scrape(port))
            finally:
                stop_server(proc)
            speeds[replicas].append(runs[replicas][0])
        report_servers(args, runs, f"round {r + 1}: ")
    if args.rounds > 1:
        one, many = statistics.median(speeds[1]), statistics.median(speeds[args.replicas])
        print(f"serve, medians of {args.rounds} rounds: one replica {one:.1f} tokens/s, D={args.replicas} "
              f"{many:.1f} tokens/s: {many / one:.2f}x")


def report_servers(args, runs: dict, prefix: str) -> None:
    (one, one_answers, one_m), (many, many_answers, many_m) = runs[1], runs[args.replicas]
    shown = range(args.replicas)
    print(f"{prefix}serve, {args.clients} clients x {args.per_client} requests of {args.max_tokens} tokens after a "
          f"shared system prompt{' (one of ' + str(args.system_prompts) + ')' if args.system_prompts > 1 else ''}, "
          f"replicas of {args.tp} rank(s): one replica {one:.1f} tokens/s, D={args.replicas} "
          f"{many:.1f} tokens/s: {many / one:.2f}x; answers the same: {one_answers == many_answers}")
    print(f"  prefix hits/lookups: one replica {hit_rate(one_m, None)}; D={args.replicas}: "
          + ", ".join(f"replica {r} {hit_rate(many_m, str(r))}" for r in shown)
          + f", all {hit_rate(many_m, 'total')}")
    routed = lambda r, why: many_m.get(("bloom_routed_requests_total", str(r), why), 0)
    print("  routed: " + ", ".join(f"replica {r} {routed(r, 'prefix'):.0f} by prefix + {routed(r, 'least_loaded'):.0f} "
                                   f"least loaded" for r in shown))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=str(ROOT / "checkpoints" / "bloom-tiny"))
    p.add_argument("--mode", choices=["split", "ceiling", "requests", "nodes", "serve", "all"], default="all")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--lines", type=int, default=64, help="request file modes: lines of the file")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3, help="request file and server modes: alternated rounds")
    p.add_argument("--tp", type=int, default=1, help="serve: ranks per replica (one thread each)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--per_client", type=int, default=4)
    p.add_argument("--max_tokens", type=int, default=48)
    p.add_argument("--system_prompts", type=int, default=1,
                   help="serve: system prompts among the clients (client c has prompt c mod N), at most 8")
    p.add_argument("--max_batch", type=int, default=8)
    p.add_argument("--max_length", type=int, default=256)
    args = p.parse_args()
    modes = ["split", "ceiling", "requests", "nodes", "serve"] if args.mode == "all" else [args.mode]
    print("load:", os.popen("uptime").read().strip())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        requests = tmp / "requests.jsonl"
        write_requests(requests, args.lines)
        if "split" in modes:
            measure_split(args.weights, requests, args.budget, args.replicas)
        if "ceiling" in modes:
            machine_ceiling(args, requests, tmp)
        for mode in ("requests", "nodes"):
            if mode in modes:
                compare_jobs(args, requests, tmp, nodes=mode == "nodes")
        if "serve" in modes:
            compare_servers(args, tmp)
    print("load:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
