"""Seeded randomness on the device, reproducible per row: the noise and the keys of sampling (the
draw itself is ``choose.draw``; beam sampling's is in ``beam.py``).

Why not ``torch.multinomial`` with a generator: one generator is shared by the whole batch, so a
row's draws would depend on which rows come before it, and a generator per row is a host object
that costs one launch per row and step. Instead every random number is a pure function of
(row key, step, token index), computed on the device by an integer hash (counter-based randomness,
like Philox in JAX). A row's draws therefore do not depend on its companions, its place in the
batch, the device or the number of steps run before.

* ``row_keys`` (host, once per call): a row's key is a hash of the seed, the row's prompt ids, how
  many identical prompts came before it in the batch, and its copy number (num_return_sequences),
  so the same prompt with the same seed samples the same text alone or in any batch, while copies
  of one prompt still sample independently.
* ``gumbel`` (device, every step): uniform noise from the hash, turned into Gumbel(0, 1) noise.
  ``argmax(scores + gumbel)`` is an exact draw from ``softmax(scores)`` (the Gumbel-max trick), and
  ``topk(scores + gumbel, k)`` draws k tokens without replacement in order of draw, the same
  distribution as ``torch.multinomial(softmax(scores), k)`` (beam sampling uses that).

Every value the hash makes stays below 2**31 and every product too (15-bit multipliers on 16-bit
halves), so it is exact in int32 as in int64: lazy mode on a Gaudi computes int64 as int32, and
the same bits come out on every device. The step is a device tensor where the loop has one, so a
captured or lazily compiled step never bakes a Python counter into its ops.
"""

from __future__ import annotations

import hashlib
from typing import Callable

import torch

_MASK = (1 << 31) - 1
_MULT = 0x6B43  # odd and below 2**15: a 16-bit half times it stays below 2**31
_STEP_SALT = 0x1234567


def _mul(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) that multiplies by ``_MULT`` half by half (no product >= 2**31):
    the low 16 bits are ``lo * M`` mod 2**16, the high 15 bits ``hi * M`` mod 2**15 mixed with the
    carries of ``lo * M``."""
    hi, lo = x >> 16, x & 0xFFFF
    return (((hi * _MULT) & 0x7FFF) << 16) ^ (lo * _MULT)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of [0, 2**31) that scrambles bits (xor-shift / multiply rounds)."""
    for _ in range(4):
        x = x ^ (x >> 15)
        x = _mul(x)
    return x ^ (x >> 16)


# (base [R] int64, n) -> [R, n] float32: ``uniform``'s noise from its per-row base, computed by a
# runtime's kernel (the CPU kernels' counter_uniform) rather than op by op.
UniformKernel = Callable[[torch.Tensor, int], torch.Tensor]


def uniform(keys: torch.Tensor, step: torch.Tensor | int, n: int, kernel: UniformKernel | None = None) -> torch.Tensor:
    """[R, n] float32 uniform in (0, 1): a pure function of (keys[r], step, column). ``step``: an
    int, a [1] tensor (every row's) or an [R] tensor (each row's own). ``kernel``: one that makes
    the same bits (``checked_uniform_kernel``), where the runtime has one."""
    base = _mix(keys ^ _mix((step + _STEP_SALT) & _MASK))  # [R]
    if kernel is not None:
        return kernel(base, n)
    columns = torch.arange(n, device=keys.device, dtype=torch.long)
    bits = _mix(base[:, None] ^ _mix(columns)[None, :])  # [R, n]
    # The top 23 bits, centred in their cell: k + 0.5 < 2**23 is exact in float32, so u is never
    # 0 or 1 (with 24 bits the top cell would round to 1.0 and its Gumbel noise to infinity).
    return ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def checked_uniform_kernel(kernel: UniformKernel) -> UniformKernel | None:
    """``kernel`` if it gives ``uniform``'s very bits on a probe (keys across [0, 2**31), steps as
    an int and per row, a ragged width), else None: a wrong kernel would change every sample
    silently, so it is never used untested."""
    keys = torch.tensor([0, 1, 7, 12345, 1 << 30, _MASK], dtype=torch.long)
    for step in (0, 3, torch.tensor([5]), torch.arange(6) * 1000):
        if not torch.equal(uniform(keys, step, 2049, kernel), uniform(keys, step, 2049)):
            return None
    return kernel


def gumbel(keys: torch.Tensor, step: torch.Tensor | int, n: int, kernel: UniformKernel | None = None) -> torch.Tensor:
    """-log(-log(u)), in place on the fresh uniform tensor: one [R, n] allocation, not four (each
    a few MB of new pages for BLOOM's vocabulary)."""
    return uniform(keys, step, n, kernel).log_().neg_().log_().neg_()


def resolve_seed(seed: int | None) -> int:
    """The user's seed, or one drawn from torch's global generator (so torch.manual_seed works)."""
    if seed is not None:
        return seed
    return int(torch.randint(0, _MASK, (1,)).item())


def sampling_seeds(do_sample: bool, seed: int | None, seed_each: list[int | None] | None) -> int | list[int] | None:
    """The seed of a search (None when greedy): ``seed``, or one drawn by ``resolve_seed`` where it
    is None; with ``seed_each``, one per prompt: its own where given, that one elsewhere (nothing is
    drawn when every prompt has its own)."""
    if not do_sample:
        return None
    if seed_each is None:
        return resolve_seed(seed)
    if all(own is not None for own in seed_each):
        return list(seed_each)
    shared = resolve_seed(seed)
    return [shared if own is None else own for own in seed_each]


def row_keys(prompt_ids: list[list[int]], seed: int | list[int], copies: int, device) -> torch.Tensor:
    """[len(prompt_ids) * copies] keys, prompt-major (copy c of prompt p at row p * copies + c).
    ``seed``: the batch's, or one per prompt (a batch of requests with different seeds). A prompt's
    occurrence counts the identical prompts with the same seed before it."""
    seeds = seed if isinstance(seed, list) else [seed] * len(prompt_ids)
    seen: dict[tuple, int] = {}
    keys = []
    for ids, own in zip(prompt_ids, seeds):
        occurrence = seen.get((own, *ids), 0)
        seen[(own, *ids)] = occurrence + 1
        for copy in range(copies):
            text = f"{own}|{occurrence}|{copy}|{','.join(map(str, ids))}".encode()
            keys.append(int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & _MASK)
    return torch.tensor(keys, dtype=torch.long, device=device)


def repeat_rows(batch, copies: int):
    """The batch with each prompt repeated ``copies`` times, prompt-major (num_return_sequences)."""
    if copies == 1:
        return batch
    from dataclasses import replace

    return replace(
        batch,
        prompts=[p for p in batch.prompts for _ in range(copies)],
        prompt_ids=[ids for ids in batch.prompt_ids for _ in range(copies)],
        input_ids=batch.input_ids.repeat_interleave(copies, dim=0),
        lengths=batch.lengths.repeat_interleave(copies),
        new_limits=batch.new_limits.repeat_interleave(copies),
        copies=copies,
    )
