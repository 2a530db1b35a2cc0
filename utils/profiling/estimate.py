"""How long a sweep will take, said before it starts: a cost model per configuration, from two rates
measured on this machine in about a second (the read bandwidth, the matrix-product rate).

A configuration's time is its warm-up (a prompt and a decode step) plus its timed rounds, each a
one-token request and a full one (``bench/generate_bench.py``'s loop). A prompt of n tokens on B
rows costs its products, 2 x (the rank's weights) x B x n operations, plus attention's; a decode
step costs the larger of reading the rank's weights and keys/values and its products. Each dtype's
weights cost their bytes at the rate pages are mapped (about 1 GB/s) and each launch a few seconds.
CPU ranks on one host share its cores and memory, so a size-T configuration takes about what one
rank would; on cards each rank has its own. Rounds follow ``Rounds``' rule with the spread never
small enough (the estimate errs long). The model is rough (within a factor of 2 here): the
profiler rescales what is left by how the finished configurations compared with it.
"""

from __future__ import annotations

import time

import torch

from .memory import BYTES_PER_WEIGHT, weights_per_rank
from .sweep import ACTIVATION_DTYPES, client_levels

PAGE_MAP_BYTES_S = 1e9  # a fresh page's first touch (the kernel maps and zeroes it)
LAUNCH_S = {1: 5.0, "deepspeed": 15.0}  # a worker's imports; the DeepSpeed launcher's start as well


def matmul_rate(dtype: torch.dtype, device: str = "cpu", size: int = 1024) -> float:
    """Operations a second of a [size, 2 size] x [2 size, 2 size] product in ``dtype`` (best of 3)."""
    a = torch.randn(size, 2 * size, device=device).to(dtype)
    b = torch.randn(2 * size, 2 * size, device=device).to(dtype)
    a @ b  # first call: the library's setup
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        a @ b
        if a.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size * (2 * size) ** 2 / best


def machine_rates(device: str = "cpu") -> dict:
    """The rates the model needs: bytes/s read, operations/s in fp32 and bf16."""
    from bench.generate_bench import read_bandwidth

    target = torch.device(device)
    return {"read_bytes_s": read_bandwidth(target, mbytes=256, repeats=3),
            "ops_s": {"float32": matmul_rate(torch.float32, device), "bfloat16": matmul_rate(torch.bfloat16, device)}}


def request_seconds(spec: dict, dtype: str, tp: int, rows: int, prompt: int, new: int, rates: dict,
                    shared: bool) -> tuple[float, float]:
    """(a prompt's seconds, a decode step's seconds, on average over ``new`` steps) of one rank."""
    act = ACTIVATION_DTYPES[dtype]
    ops = rates["ops_s"][act] / (tp if shared else 1)
    read = rates["read_bytes_s"] / (tp if shared else 1)
    h, layers = spec["hidden_size"], spec["n_layer"]
    sharded, replicated = weights_per_rank(spec, tp)
    products = layers * 12 * h * h / tp  # the weights a token multiplies (the head only once a step)
    attention = 4 * layers * h / tp  # per (token, key) pair: scores and the weighted sum
    prompt_s = (2 * products * rows * prompt + attention * rows * prompt * prompt / 2) / ops
    element = torch.empty((), dtype=getattr(torch, act)).element_size()
    weight_bytes = sharded * BYTES_PER_WEIGHT[dtype] + replicated * element
    kv_bytes = 2 * layers * rows * h / tp * (prompt + new / 2) * element
    step_ops = 2 * (products + spec["vocab_size"] * h / tp) * rows + attention * rows * (prompt + new / 2)
    return prompt_s, max((weight_bytes + kv_bytes) / read, step_ops / ops)


def rounds_of(full_s: float, plan: dict) -> int:
    rounds = plan["min_repeats"]
    while rounds < plan["repeats"] and rounds * full_s < plan["min_timed_s"]:
        rounds += 1
    return rounds


def config_seconds(spec: dict, config: dict, plan: dict, rates: dict, shared: bool) -> float:
    """One configuration's seconds, warm-up and timed rounds (online: each client level's requests)."""
    tp, dtype, rows = config["tp"], config["dtype"], config["max_batch"]
    prompt, new = config["input_len"], config["output_len"]
    if config["scenario"] == "offline":
        prompt_s, step_s = request_seconds(spec, dtype, tp, rows, prompt, new, rates, shared)
        full_s = prompt_s + (new - 1) * step_s
        return plan["warmup"] * (prompt_s + step_s) + rounds_of(full_s, plan) * (prompt_s + full_s)
    total = 0.0
    for clients in client_levels(rows):
        prompt_s, step_s = request_seconds(spec, dtype, tp, clients, prompt, new, rates, shared)
        requests = max(4, plan["requests_per_client"] * clients)
        total += (requests / clients + 1) * (prompt_s + new * step_s)
    return total + 2 * prompt_s  # the server's warm-up: its shapes once


def sweep_seconds(spec: dict, configs: list[dict], plan: dict, rates: dict, shared: bool) -> dict:
    """{"configs": {key: seconds}, "startup": seconds of launches and weights, "total": seconds}."""
    per_config = {c["key"]: config_seconds(spec, c, plan, rates, shared) for c in configs}
    startup = 0.0
    for tp in dict.fromkeys(c["tp"] for c in configs):
        startup += LAUNCH_S[1 if tp == 1 else "deepspeed"]
        for dtype in dict.fromkeys(c["dtype"] for c in configs if c["tp"] == tp):
            sharded, replicated = weights_per_rank(spec, tp)
            element = torch.empty((), dtype=getattr(torch, ACTIVATION_DTYPES[dtype])).element_size()
            drawn = (sharded + replicated) * element * (tp if shared else 1)  # quantized: drawn first, then packed
            startup += drawn / PAGE_MAP_BYTES_S * (2 if dtype in ("int8", "int4") else 1)
    return {"configs": per_config, "startup": startup, "total": startup + sum(per_config.values())}


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
