#!/usr/bin/env python3
"""Where a draft model runs under tensor parallelism (issue 44): on every rank, each rank its slice
of every product as the target is split (what ``--speculate draft`` does), or whole on rank 0 with
its guesses broadcast to the other ranks.

A pass that drafts K guesses costs, per placement:

* every rank: K decode steps of the draft split over the T ranks (their collectives included);
* rank 0:     K decode steps of the whole draft on one rank's threads, then one broadcast of the
              rows' K guesses (the other ranks wait).

Timed here, alternating ``--rounds`` times, on the same draft (the target's first
``--draft_layers`` blocks, ``utils/first_layers.py``) and a cache holding a ``--prompt_len``-token
prompt:

* ``split``: one decode step under ``torchrun --nproc_per_node T`` (``--threads`` each);
* ``whole``: one decode step of the whole draft in one process with ``--threads``;
* ``broadcast``: rank 0 sending [rows, K] guesses over the launch's process group.

    python bench/draft_placement_bench.py --config bloom-560m --dtype bf16 --draft_layers 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.generate_bench import checkpoint_folder, log  # noqa: E402
from bloom_hpu.runtime.launch import exit_process, init_parallel  # noqa: E402
from bloom_hpu.runtime.steps import step_input  # noqa: E402
from generation.generator import Generator, parse_dtype  # noqa: E402
from utils.first_layers import first_layers  # noqa: E402


def decode_ms(generator: Generator, rows: int, prompt_len: int, steps: int) -> float:
    """Median ms of one decode step of ``rows`` rows over a cache holding ``prompt_len`` tokens."""
    runner = generator.runner
    length = prompt_len + steps + 4
    cache = runner.cache(rows, length)
    ids = torch.arange(3, 3 + prompt_len).repeat(rows, 1)
    runner.prefill(step_input(ids), torch.full((rows,), prompt_len), cache)
    token = torch.full((rows, 1), 7)
    times = []
    for i in range(steps + 2):  # the first two untimed
        start = torch.full((rows,), prompt_len + i)
        t = time.perf_counter()
        runner.decode(step_input(token), step_input(start), cache, length)
        if i >= 2:
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def collective_ms(call, steps: int) -> float:
    """Median ms of ``call()``, a collective, every rank starting together."""
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def collectives(generator: Generator, rows: int, k: int, steps: int) -> dict:
    """The collectives' own times: the guesses' broadcast (rank 0's placement), and what a split
    decode step carries: an all-reduce of [rows, hidden] per block's two row-parallel products,
    an all-gather of each rank's [rows, vocab / T] logits."""
    config, dtype = generator.model.config, generator.model.ln_f.weight.dtype
    world = torch.distributed.get_world_size()
    guesses = torch.zeros(rows, k, dtype=torch.long)
    hidden = torch.zeros(rows, config.hidden_size, dtype=dtype)
    shard = torch.zeros(rows, -(-config.vocab_size // world), dtype=dtype)
    pieces = [torch.empty_like(shard) for _ in range(world)]
    return {"broadcast_ms": collective_ms(lambda: torch.distributed.broadcast(guesses, src=0), steps),
            "all_reduce_ms": collective_ms(lambda: torch.distributed.all_reduce(hidden), steps),
            "all_gather_ms": collective_ms(lambda: torch.distributed.all_gather(pieces, shard), steps),
            "all_reduces": 2 * config.n_layer}


def role(args) -> None:
    """One measurement in this process: the split draft (under the launcher) or the whole one."""
    parallel = init_parallel("cpu")
    torch.set_num_threads(args.threads)  # after the launcher's own split of the cores, which it would override
    generator = Generator.from_pretrained(args.draft, dtype=args.dtype, parallel=parallel)
    result = {"decode_ms": decode_ms(generator, args.rows, args.prompt_len, args.steps)}
    if parallel.world_size > 1:
        result.update(collectives(generator, args.rows, args.k, 10 * args.steps))
    if parallel.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    if parallel.world_size > 1:
        torch.distributed.barrier()
        exit_process(0)  # a rank's interpreter exit can abort in the distributed stack's destructors


def run_role(args, ranks: int) -> dict:
    """The ``role`` measurement in a fresh process (``ranks`` > 1: under torchrun); its result."""
    own = [str(Path(__file__).resolve()), "--role", "--draft", str(args.draft), "--dtype", args.dtype,
           "--threads", str(args.threads), "--rows", str(args.rows), "--prompt_len", str(args.prompt_len),
           "--steps", str(args.steps), "--k", str(args.k)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false")
    if ranks > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                   "--master_port", str(args.master_port)] + own
    else:
        command = [sys.executable] + own
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"error: the {'split' if ranks > 1 else 'whole'} measurement failed")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="bloom-560m", help="the target: tiny, bloom-560m, bloom-1b1 or a folder")
    p.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--draft_layers", type=int, default=4, help="the draft: the target's first N blocks")
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks T")
    p.add_argument("--threads", type=int, default=1, help="threads of each rank, and of the whole draft's process")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--k", type=int, default=4, help="guesses a pass")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="decode steps timed a measurement")
    p.add_argument("--rounds", type=int, default=3, help="alternated split / whole measurements")
    p.add_argument("--master_port", type=int, default=29533)
    p.add_argument("--role", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--draft", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        role(args)
        return 0

    target = checkpoint_folder(args.config, parse_dtype(args.dtype))
    args.draft = Path(tempfile.mkdtemp(prefix="draft_placement_")) / f"first{args.draft_layers}"
    first_layers(target, args.draft, args.draft_layers)
    log(f"draft: the first {args.draft_layers} blocks of {target} ({args.dtype}); {args.ranks} ranks x "
        f"{args.threads} thread(s) against one process of {args.threads}; {args.rows} row(s), K = {args.k}")
    split, whole, cast, parts = [], [], [], []
    for r in range(args.rounds):
        for name in (("split", "whole") if r % 2 == 0 else ("whole", "split")):
            if name == "split":
                got = run_role(args, args.ranks)
                split.append(got["decode_ms"])
                cast.append(got["broadcast_ms"])
                parts.append(got)
            else:
                whole.append(run_role(args, 1)["decode_ms"])
            log(f"round {r + 1}: {name} done")
    s, w, b = statistics.median(split), statistics.median(whole), statistics.median(cast)
    every, rank0 = args.k * s, args.k * w + b
    print(f"draft decode step: split over {args.ranks} ranks {s:.2f} ms, whole on one rank {w:.2f} ms; "
          f"broadcast of [{args.rows}, {args.k}] guesses {b:.3f} ms")
    reduce = statistics.median(g["all_reduce_ms"] for g in parts)
    gather = statistics.median(g["all_gather_ms"] for g in parts)
    print(f"the split step's collectives: {parts[0]['all_reduces']} all-reduces of [{args.rows}, hidden] "
          f"{reduce:.3f} ms each, one all-gather of the logits {gather:.3f} ms: "
          f"{parts[0]['all_reduces'] * reduce + gather:.2f} ms a step")
    print(f"a pass of K = {args.k} guesses: every rank {every:.1f} ms, rank 0 + broadcast {rank0:.1f} ms "
          f"(rank 0 / every rank: {rank0 / every:.2f}x)")
    print(f"rounds: split {', '.join(f'{x:.2f}' for x in split)}; whole {', '.join(f'{x:.2f}' for x in whole)}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
