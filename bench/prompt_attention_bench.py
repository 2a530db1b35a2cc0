#!/usr/bin/env python3
"""A prefill with the CPU's one-call prompt attention against the op-by-op one, same model.

Times ``StaticBloom.prefill`` of one prompt of ``--real`` tokens padded to ``--padded`` slots, the
two attentions alternated (so a drift in the machine's load hits both alike), after two untimed
runs of each; prints the medians and every run. With ``--attention_only``, times one block's
attention alone (``Attention.attend_prompt`` on a random ``query_key_value`` output, without the
products around it). See "One C++ call per step" in docs/performance.md.

    OMP_NUM_THREADS=2 python bench/prompt_attention_bench.py --config bloom-560m --dtype bf16 --padded 128 --real 128
    OMP_NUM_THREADS=2 python bench/prompt_attention_bench.py --config bloom-560m --dtype bf16 --padded 512 --real 512 --attention_only
    OMP_NUM_THREADS=2 python bench/prompt_attention_bench.py --config tiny --padded 2048 --real 56
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.generate_bench import checkpoint_folder  # noqa: E402
from bloom_hpu.model import Prompt  # noqa: E402
from bloom_hpu.runtime.cpu import CpuOptions  # noqa: E402
from generation.generator import Generator, parse_dtype  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny", help="tiny, bloom-560m, bloom-1b1 or a checkpoint folder")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--padded", type=int, default=128, help="prompt slots (the static length)")
    p.add_argument("--real", type=int, default=128, help="real tokens in the prompt")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--attention_only", action="store_true", help="time one block's attention, not the prefill")
    p.add_argument("--cpu_path", default="auto", help="auto, avx512_bf16 or avx2 (the kernel build to time)")
    args = p.parse_args(argv)
    if not 1 <= args.real <= args.padded:
        p.error("need 1 <= --real <= --padded")
    if args.threads:
        torch.set_num_threads(args.threads)
    generator = Generator.from_pretrained(checkpoint_folder(args.config, parse_dtype(args.dtype)), dtype=args.dtype,
                                          cpu=CpuOptions(path=args.cpu_path))
    model, plan = generator.model, generator.backend.cpu_plan
    if not plan.prompt_attention:
        print(f"no one-call prompt attention here (CPU fast path: {generator.backend.fast_path})")
        return 1
    ids = torch.randint(5, 1000, (1, args.padded))
    lengths = torch.tensor([args.real])
    cache = model.allocate_cache(1, args.padded)

    if args.attention_only:
        attention, config = model.h[0].self_attention, model.config
        qkv = torch.randn(1, args.padded, 3 * config.hidden_size).to(next(model.parameters()).dtype)

        def run(one_call: bool):
            prompt = Prompt(lengths, args.padded)
            with contextlib.nullcontext() if one_call else plan.op_by_op():
                attention.attend_prompt(qkv, 0, cache, prompt)
    else:
        def run(one_call: bool):
            with contextlib.nullcontext() if one_call else plan.op_by_op():
                model.prefill(ids, lengths, cache)

    def timed(one_call: bool) -> float:
        with torch.no_grad():
            started = time.perf_counter()
            run(one_call)
            return (time.perf_counter() - started) * 1e3

    for one_call in (True, False, True, False):
        timed(one_call)
    runs = {"one call": [], "op by op": []}
    for _ in range(args.repeats):
        runs["one call"].append(timed(True))
        runs["op by op"].append(timed(False))
    what = "one block's attention" if args.attention_only else "prefill"
    print(f"{what} of {args.real} real tokens padded to {args.padded}, {args.dtype}, "
          f"{torch.get_num_threads()} threads ({args.config}):")
    for name, times in runs.items():
        digits = 2 if max(times) < 10 else 0  # one block's attention can take under a millisecond
        print(f"  {name:9s} {statistics.median(times):8.{max(digits, 1)}f} ms  "
              f"(runs: {', '.join(f'{t:.{digits}f}' for t in times)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
