#!/usr/bin/env python3
"""Batch-1 decode of ours and llama.cpp in one process, alternated request by request.

``peers_bench.py`` runs each engine in a process of its own, one after the other; where both
engines only stream the same bytes from memory (fp32 and bf16 batch-1 decode), a guest whose
memory bandwidth moves between those processes moves the ratio with it. Here both engines are
loaded once, into one process, and their decode requests alternate, so that each pair of
requests meets the same machine; the ratio is taken per pair.

It reads what a ``peers_bench.py --json`` run wrote (the checkpoint, the conversions, the token
ids, the threads) and times its 16-token prompt's decode as that bench does: (a request for
``--new_tokens`` tokens − a request for one) / (``--new_tokens`` − 1)::

    python bench/peers_bench.py --formats fp32,bf16 --engines ours,llama.cpp --json /tmp/peers.json
    python bench/decode_interleaved.py --from_json /tmp/peers.json --format bf16 --pairs 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers_bench  # noqa: E402


def ms_per_token(engine, prompt: list[int], new_tokens: int) -> float:
    started = time.perf_counter()
    engine.generate([prompt], 1)
    first = time.perf_counter() - started
    started = time.perf_counter()
    engine.generate([prompt], new_tokens)
    whole = time.perf_counter() - started
    return (whole - first) * 1e3 / (new_tokens - 1)


def interleaved(engines: list, prompt: list[int], new_tokens: int, pairs: int) -> list[tuple[float, float]]:
    """(ours, llama.cpp) ms/token of each pair of requests, the engines' order reversed every other
    pair so that neither always runs first."""
    out = []
    for i in range(pairs):
        order = engines if i % 2 == 0 else engines[::-1]
        got = {engine.name: ms_per_token(engine, prompt, new_tokens) for engine in order}
        out.append((got["ours"], got["llama.cpp"]))
        print(f"pair {i}: ours {out[-1][0]:.1f} ms/token, llama.cpp {out[-1][1]:.1f}, "
              f"ours / llama.cpp {out[-1][0] / out[-1][1]:.3f}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from_json", required=True, help="a peers_bench.py --json output")
    p.add_argument("--format", default="bf16", choices=["fp32", "bf16", "int8", "int4"])
    p.add_argument("--pairs", type=int, default=8, help="requests of each engine, alternated")
    p.add_argument("--new_tokens", type=int, default=64)
    args = p.parse_args()
    try:
        run = json.loads(Path(args.from_json).read_text())
        spec = dict(run["spec"], prompts=run["prompt_ids"])
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"decode_interleaved: {args.from_json} is not a peers_bench.py --json output ({e})")
    if args.format not in spec["gguf"]:
        sys.exit(f"decode_interleaved: that run has no {args.format} conversion for llama.cpp")
    engines = [peers_bench.Ours(spec, args.format), peers_bench.LlamaCpp(spec, args.format)]
    prompt = spec["prompts"]["p16"][0]["ids"]
    for engine in engines:  # warm-up
        ms_per_token(engine, prompt, args.new_tokens)
    pairs = interleaved(engines, prompt, args.new_tokens, args.pairs)
    ratios = [ours / llama for ours, llama in pairs]
    print(f"{args.format} batch-1 decode, {spec['threads']} threads each: ours / llama.cpp median "
          f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f} over {len(pairs)} pairs)")


if __name__ == "__main__":
    main()
