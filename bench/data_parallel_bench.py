#!/usr/bin/env python3
"""Data parallelism on a request file: D replicas against one process (``--data_parallel``).

Two measurements on one request file of lines of mixed length (64 by default, written here):

1. **The split**: one process answers every planned batch and times each one; the bench then deals
   those batches to D replicas the way ``generation/jobs/data_parallel.py`` does (``deal``: the
   costliest first, to the least loaded replica, by the batch's rows x static length) and the plain
   way (``deal_in_turn``: batch i to replica i mod D), and prints each split's makespan (the
   slowest replica's measured seconds) against the ideal (total / D). The batches' times are
   measured; only the assignment is computed, so the figure says how even each split is, not how
   fast two processes run side by side.
2. **End to end**: ``bloom.py --requests`` as one 1-thread process, then under ``torchrun
   --nproc_per_node D --data_parallel D`` (1 thread per rank), alternating ``--rounds`` times;
   lines/s of each (median), their ratio, and whether the results files are the same but for
   timings. On a shared machine the ratio moves with everyone else's load: print ``uptime`` with it.

    python bench/data_parallel_bench.py --weights checkpoints/bloom-tiny [--lines 64] [--replicas 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
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
    for name, shares in (("deal (costliest first)", deal([batch_cost(b) for b in batches], replicas)),
                         ("in turn (i mod D)", deal_in_turn(len(batches), replicas))):
        loads = [sum(seconds[i] for i in share) for share in shares]
        print(f"  {name:24s} replicas {', '.join(f'{x:.2f}' for x in loads)} s; "
              f"makespan {max(loads):.2f} s = {max(loads) / ideal:.3f} x ideal")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(weights: str, requests: Path, results: Path, budget: int, replicas: int) -> float:
    results.unlink(missing_ok=True)
    command = [sys.executable]
    if replicas > 1:
        command += ["-m", "torch.distributed.run", "--nproc_per_node", str(replicas), "--master_port", str(free_port())]
    command += [str(ROOT / "bloom.py"), "--weights", weights, "--requests", str(requests), "--results", str(results),
                "--budget", str(budget), "--prefix_cache", "0", "--quiet", "--data_parallel", str(replicas)]
    done = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    # The job's own figure (rank 0's summary: reading, planning, answering, joining), not the start-up.
    summary = [line for line in done.stderr.splitlines() if "requests answered" in line][-1]
    return float(summary.rsplit(" in ", 1)[1].split(" s")[0])


def without_timings(path: Path) -> list[str]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        r["result"].pop("request_time")
    return [json.dumps(r) for r in records]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--weights", default=str(ROOT / "checkpoints" / "bloom-tiny"))
    p.add_argument("--lines", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip_split", action="store_true")
    args = p.parse_args()
    print("load:", os.popen("uptime").read().strip())
    with tempfile.TemporaryDirectory() as tmp:
        requests = Path(tmp) / "requests.jsonl"
        write_requests(requests, args.lines)
        if not args.skip_split:
            measure_split(args.weights, requests, args.budget, args.replicas)
        one_s, many_s = [], []
        for _ in range(args.rounds):
            one_s.append(run_job(args.weights, requests, Path(tmp) / "one.jsonl", args.budget, 1))
            many_s.append(run_job(args.weights, requests, Path(tmp) / "many.jsonl", args.budget, args.replicas))
        one, many = statistics.median(one_s), statistics.median(many_s)
        same = without_timings(Path(tmp) / "one.jsonl") == without_timings(Path(tmp) / "many.jsonl")
        print(f"end to end, {args.lines} lines: one process {args.lines / one:.1f} lines/s ({one:.2f} s), "
              f"D={args.replicas} {args.lines / many:.1f} lines/s ({many:.2f} s): {one / many:.2f}x; "
              f"results the same but for timings: {same}")
    print("load:", os.popen("uptime").read().strip())


if __name__ == "__main__":
    main()
