"""What each rank of one tensor-parallel size runs: every configuration of its plan, in order.

Started by ``utils/profile_configs.py`` with a plan file (JSON): alone for one rank, under the
DeepSpeed launcher for more. Per dtype it draws one set of random weights (``random_model.py``),
shared by that dtype's configurations; before each configuration it checks the memory it needs
(``memory_need``) against what is free, and skips it, with both figures, rather than run out.
A configuration is measured by the benchmarks' own code: offline by ``bench/generate_bench.py``'s
timing (``time_variants``), online by ``bench/serve_bench.py``'s server and load client. Rank 0
appends one JSON line per configuration to the plan's records file; the profiler reads it as it grows.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

STARTED = time.time()  # before torch and the library are imported: a start-up figure counts them

ROOT = Path(__file__).resolve().parent.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from utils.profiling.memory import Need, free_per_rank, memory_need  # noqa: E402
from utils.profiling.sweep import ACTIVATION_DTYPES, QUANTIZED, client_levels  # noqa: E402


SHOWS_OUTPUT = True  # rank 0 alone prints (Rank sets it)


def log(message: str) -> None:
    if SHOWS_OUTPUT:
        print(f"[profile] {message}", file=sys.stderr, flush=True)


class Rank:
    """This process's place in the run: its Parallel, and whether it writes records."""

    def __init__(self, device: str | None):
        from bloom_hpu.runtime.launch import init_parallel, route_output

        global SHOWS_OUTPUT

        self.parallel = init_parallel(device)
        self.leader = self.parallel.rank == 0
        SHOWS_OUTPUT = route_output(self.parallel, False)


# --------------------------------------------------------------------------- offline


def agreement(parallel):
    """``Rounds.agree`` for this run: under tensor parallelism a round count every rank takes (they
    stop when all would), so the ranks run the same requests and meet in the same collectives."""
    if parallel.world_size <= 1:
        return lambda stop: stop

    def agree(stop: bool) -> bool:
        flag = torch.tensor([int(stop)], device=getattr(parallel, "device", "cpu"))
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=getattr(parallel, "group", None))
        return bool(flag.item())

    return agree


def run_offline(generator, config: dict, plan: dict, parallel) -> dict:
    """Static batches of ``max_batch`` prompts of ``input_len`` tokens, ``output_len`` new tokens
    each (EOS ignored, speculating as ``config["speculate"]`` says), timed by generate_bench's loop:
    its TTFT, decode ms/token and tokens/s, and the time of a whole batch.

    What keeps a sweep short: the warm-up is a prompt and one decode step (with static shapes every
    step has the shape of one of these), and the timed rounds stop early (``Rounds``): once the full
    requests timed add up to ``min_timed_s`` (a long request averages over its many steps already)
    or two rounds agree within ``spread``; at most ``repeats``."""
    from bench.generate_bench import Rounds, Variant, make_prompts, time_variants, timing_row
    from generation.request.options import build_options

    batch, prompt_len, new = config["max_batch"], config["input_len"], config["output_len"]
    prompts = make_prompts(generator.tokenizer, batch, prompt_len)
    opts = build_options(max_length=prompt_len + new, ignore_eos=True)
    speculate = config.get("speculate", "off")
    variant = Variant("ours", lambda n: generator.generate(prompts, opts.updated(max_new_tokens=n), speculate=speculate))
    rounds = Rounds(plan["repeats"], min_repeats=plan["min_repeats"], min_timed_s=plan["min_timed_s"],
                    spread=plan["spread"], agree=agreement(parallel))
    ttft, full = time_variants([variant], warmup=plan["warmup"], repeats=rounds, new_tokens=new,
                               device=generator.device, warmup_tokens=min(2, new))
    stats = generator._speculated  # the last full request's speculation, None without
    row = timing_row("ours", ttft["ours"], full["ours"], batch, new)
    generator.runner.release_caches()  # the next configuration's shape gets the memory
    figures = {"ttft_ms": row.ttft_ms, "decode_ms_per_token": row.decode_ms_per_token,
               "tokens_per_s": row.tokens_per_s, "batch_s": sorted(full["ours"])[len(full["ours"]) // 2],
               "runs_ms": row.runs_ms, "ttft_runs_ms": [round(t * 1e3, 2) for t in ttft["ours"]]}
    if stats is not None:
        figures.update(acceptance=stats.acceptance, tokens_per_verify=stats.tokens_per_verify)
    return figures


# --------------------------------------------------------------------------- online


def serve_settings(config: dict, plan: dict) -> SimpleNamespace:
    """serve_bench's settings for one configuration: the engine's rows and static length."""
    return SimpleNamespace(max_batch=config["max_batch"], max_length=config["input_len"] + config["output_len"],
                           bucket_width=plan["bucket_width"], max_prefill=4, prefill_chunk=64, burst_wait_ms=8.0)


def run_online(generator, config: dict, plan: dict, rank: Rank) -> dict | None:
    """The server (serve_bench's engine + HTTP app) with ``max_batch`` rows, and closed-loop
    clients at each level of ``client_levels`` (serve_bench's load client in a process of its own):
    per level TTFT and inter-token p50/p99, tokens/s, requests/s. Rank 0 serves; the other ranks
    follow its steps until it closes the rows. Returns the levels on rank 0, None elsewhere."""
    from bench.generate_bench import make_prompts
    from bench.load_client import measure, stream_request
    from bench.serve_bench import engine_config, ours, summarize
    from generation.serving.device_rows import DeviceRows

    settings = serve_settings(config, plan)
    engine = engine_config(settings)
    rows = DeviceRows(generator, engine.max_batch, engine.max_length, engine.bucket_width, engine.max_prefill,
                      engine.prefill_chunk)
    if rank.parallel.world_size > 1:
        from generation.serving.tp_serving import LeaderRows, follow

        if not rank.leader:
            follow(rows)  # until rank 0's engine stops and closes the rows
            return None
        rows = LeaderRows(rows)
    port, stop = ours(generator, settings, device_rows=rows)
    levels = []
    try:
        n_in, n_out = config["input_len"], config["output_len"]
        for clients in client_levels(config["max_batch"]):
            count = max(4, plan["requests_per_client"] * clients)
            # Prompts of exactly n_in tokens (serve_bench's random words may re-encode to one more,
            # past the static length of n_in + n_out).
            prompts = make_prompts(generator.tokenizer, count, n_in)
            bodies = [{"prompt": p, "max_tokens": n_out, "temperature": 0.0, "ignore_eos": True} for p in prompts]
            stream_request(port, bodies[0])  # untimed: connections, allocator
            log(f"  {clients} client(s), {count} requests")
            timings, wall, _ = measure(port, bodies, "closed", clients, plan["seed"])
            levels.append({"clients": clients, **summarize("ours", f"{clients} clients", timings, wall)})
    finally:
        stop()
    generator.runner.release_caches()
    return {"levels": levels}


# --------------------------------------------------------------------------- the plan


def dtype_of(name: str) -> tuple[torch.dtype, str | None]:
    """(activation dtype, quantization) of a --dtypes entry: int8 and int4 are quantized weights,
    over activations (and cache) in bf16, with the library's default products (int8_activations auto)."""
    return getattr(torch, ACTIVATION_DTYPES[name]), name if name in QUANTIZED else None


def run_plan(plan: dict) -> int:
    from generation.request.memory import human

    from utils.profiling.random_model import build_generator

    rank = Rank(plan["device"])
    records = Path(plan["records"])
    spec = plan["spec"]
    folder = Path(plan["model_dir"])

    def record(config: dict, **fields) -> None:
        if rank.leader:
            with records.open("a") as f:
                f.write(json.dumps({**config, **fields}) + "\n")

    by_dtype: dict[str, list[dict]] = {}
    for config in plan["configs"]:
        by_dtype.setdefault(config["dtype"], []).append(config)
    for dtype_name, configs in by_dtype.items():
        act_dtype, quantize = dtype_of(dtype_name)
        # The weights are drawn once for all of the dtype's configurations: worth it if the least
        # of them fits beside them (the others are checked one by one below).
        least = min((memory_need(spec, dtype_name, c, rank.parallel.world_size, plan["prefix_cache_bytes"])
                     for c in configs), key=lambda need: need.loading)
        free = free_per_rank(plan["device"], rank.parallel)
        if free is not None and least.loading > free:
            for config in configs:
                need = memory_need(spec, dtype_name, config, rank.parallel.world_size, plan["prefix_cache_bytes"])
                log(f"skip {config['key']}: needs {human(need.total)} per rank, {human(free)} free")
                record(config, status="skipped", need_bytes=need.total, free_bytes=free,
                       reason=f"needs {human(need.total)} per rank ({need.describe()}), {human(free)} free")
            continue
        log(f"drawing random {dtype_name} weights on {rank.parallel.world_size} rank(s)")
        start = time.perf_counter()
        generator = build_generator(folder, dtype=act_dtype, quantize=quantize, device=plan["device"],
                                    parallel=rank.parallel, seed=plan["seed"], prefix_cache=plan["prefix_cache_bytes"])
        startup_s = time.perf_counter() - start
        ready_s = round(time.time() - STARTED, 2)  # the first dtype's: the process's start-up
        log(f"weights ready in {startup_s:.1f} s ({ready_s:.1f} s after the process started)")
        for config in configs:
            need: Need = memory_need(spec, dtype_name, config, rank.parallel.world_size, plan["prefix_cache_bytes"])
            free = free_per_rank(plan["device"], rank.parallel)
            # The weights (and the prefix pool) are held already: what this configuration adds must fit.
            if free is not None and need.added > free:
                log(f"skip {config['key']}: needs {human(need.added)} more per rank, {human(free)} free")
                record(config, status="skipped", need_bytes=need.total, free_bytes=free + need.held,
                       reason=f"needs {human(need.total)} per rank ({need.describe()}), "
                              f"{human(free + need.held)} free")
                continue
            log(f"measuring {config['key']}")
            try:
                started = time.perf_counter()
                if config["scenario"] == "offline":
                    figures = {"offline": run_offline(generator, config, plan, rank.parallel)}
                else:
                    figures = run_online(generator, config, plan, rank)
            except Exception as error:  # one configuration's failure is its row, not the sweep's end
                if rank.parallel.world_size > 1:
                    raise  # the other ranks wait in a collective: end the launch (the profiler marks it)
                log(traceback.format_exc())
                generator.runner.release_caches()
                record(config, status="failed", reason=f"{type(error).__name__}: {error}")
                continue
            record(config, status="measured", startup_s=startup_s, wall_s=round(time.perf_counter() - started, 2),
                   ready_s=ready_s, need_bytes=need.total,
                   fast_path=generator.backend.fast_path, threads=torch.get_num_threads(), **(figures or {}))
        del generator
        gc.collect()
    return 0


def main(argv: list[str]) -> int:
    from bloom_hpu.runtime.launch import exit_process

    plan = json.loads(Path(argv[-1]).read_text())
    if plan.get("threads"):
        torch.set_num_threads(plan["threads"])
    code = run_plan(plan)
    exit_process(code)


if __name__ == "__main__":
    main(sys.argv)
