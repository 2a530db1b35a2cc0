"""How much memory a generate call takes, and how much the device has free.

The estimate counts what grows with the request (the weights are already loaded):

- the KV cache: keys and values of every layer, ``rows x length x hidden`` each, in the dtype;
- the prefill's attention scores, ``rows x heads x prompt x length`` (fp32), and its activations;
- the step buffers: a row's logits over the vocabulary (fp32, a few copies for the processors and
  the beams' candidates), token and position buffers ``rows x length`` (int64).

It is an upper bound within a small factor, meant to refuse what cannot possibly fit (a
``max_length`` of a billion) before anything is allocated, never to refuse what fits.
"""

from __future__ import annotations

import torch

try:
    import psutil  # optional: MemAvailable from /proc/meminfo otherwise
except ImportError:
    psutil = None


class MemoryCheckError(ValueError):
    """A call that would not fit in memory; the message names the numbers and what to lower."""


def estimate_bytes(config, dtype: torch.dtype, rows: int, length: int, prompt_len: int, world_size: int = 1) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    hidden = config.hidden_size // world_size
    heads = max(1, config.n_head // world_size)
    kv_cache = 2 * config.n_layer * rows * length * hidden * item
    prefill = rows * heads * prompt_len * length * 4 + 8 * rows * prompt_len * config.hidden_size * item
    step = 4 * rows * config.vocab_size * 4 + 4 * rows * length * 8
    return kv_cache + prefill + step


def free_bytes(device: torch.device) -> int | None:
    """Memory free on ``device``; None when it cannot be told (then nothing is refused)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    if device.type == "hpu":
        try:  # Habana's bridge: the device's allocator limit and what is in use
            import habana_frameworks.torch.hpu as hthpu

            stats = hthpu.memory_stats()
            return int(stats["Limit"]) - int(stats["InUse"])
        except (ImportError, AttributeError, KeyError, RuntimeError):
            return None
    if device.type != "cpu":
        return None
    if psutil is not None:
        return psutil.virtual_memory().available
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def agreed_free_bytes(device: torch.device, parallel=None) -> int | None:
    """``free_bytes``, the smallest over the ranks of a tensor-parallel run: every rank must take
    the same decision, or the ranks that go on would wait for the one that refused."""
    free = free_bytes(device)
    if parallel is None or parallel.world_size <= 1:
        return free
    # In MiB, so the number fits int32 (lazy mode on a Gaudi computes int64 as int32).
    mib = -1 if free is None else free >> 20
    value = torch.tensor([mib], dtype=torch.int64, device=getattr(parallel, "device", "cpu"))
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN, group=getattr(parallel, "group", None))
    smallest = int(value.item())
    return None if smallest < 0 else smallest << 20


def human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
