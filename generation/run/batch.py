"""Text in, padded token tensors out (and back): the tokenizer and the static-shape plan.

Prompts are right-padded: row b's tokens sit in slots 0..len_b-1, so every row's first token is at
slot 0 and ALiBi needs no per-row offset (see ``bloom_hpu/alibi.py``). ``ShapePlan`` fixes, before
the first step, the padded prompt length, the cache length and the attention window of every decode
step, from the options alone (static shapes) or from the batch (dynamic shapes, bucketing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from ..request.options import GenerationOptions


class InputError(ValueError):
    """Bad prompts (too long, empty list...); the message is meant for the user as is."""


class BloomTokenizer:
    """The checkpoint's ``tokenizer.json`` through the ``tokenizers`` library (no transformers)."""

    def __init__(self, folder: str | Path, eos_token_id: int = 2, pad_token_id: int = 3):
        self._tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        config_path = Path(folder) / "tokenizer_config.json"
        self.config = json.loads(config_path.read_text()) if config_path.exists() else {}

    def encode(self, text: str) -> list[int]:
        # BLOOM adds no BOS/EOS when encoding; add_special_tokens=False keeps it so whatever
        # post-processor a tokenizer.json carries.
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def id_to_token(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def to_json(self) -> str:
        """The tokenizer.json (what a grammar library reads the vocabulary from)."""
        return self._tok.to_str()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class ShapePlan:
    """Shapes of one generate call. Every field is a host int known before the first step."""

    prompt_len: int  # P: prompts are padded to this many slots
    cache_len: int  # K: slots per row in the KV cache
    longest_prompt: int
    bucket_width: int  # 0: no buckets
    static: bool

    def window(self, step: int) -> int:
        """Key slots the decode step ``step`` (0-based) attends over.

        The token fed at step s sits at slot len_b + s < longest_prompt + s + 1. Static shapes
        attend the whole cache; buckets round that bound up; dynamic shapes follow it exactly.
        """
        needed = self.longest_prompt + step + 1
        if self.bucket_width:
            return min(self.cache_len, round_up(needed, self.bucket_width))
        return self.cache_len if self.static else min(self.cache_len, needed)


def plan_shapes(lengths: list[int], reach: list[int], options: GenerationOptions) -> ShapePlan:
    """``lengths``: prompt tokens per row; ``reach``: prompt + new tokens per row (<= max_length)."""
    longest, furthest = max(lengths), max(reach)
    if options.bucket_width:
        width = options.bucket_width
        prompt_len = min(round_up(longest, width), round_up(options.max_length, width))
        cache_len = max(prompt_len, round_up(furthest, width))
        return ShapePlan(prompt_len, cache_len, longest, width, True)
    if options.static_shapes:
        return ShapePlan(options.max_length, options.max_length, longest, 0, True)
    return ShapePlan(longest, max(longest, furthest), longest, 0, False)


@dataclass
class Batch:
    prompts: list[str]
    prompt_ids: list[list[int]]
    input_ids: torch.Tensor  # [B, P] right-padded with pad_token_id
    lengths: torch.Tensor  # [B] real prompt tokens per row
    new_limits: torch.Tensor  # [B] new tokens each row may produce (>= 1)
    steps: int  # iterations of the token loop: the largest per-row budget
    plan: ShapePlan
    copies: int = 1  # each prompt fills this many consecutive rows (sampled num_return_sequences)

    @property
    def size(self) -> int:
        return len(self.prompts)


def encode_prompts(tokenizer: BloomTokenizer, prompts: list[str | list[int]]) -> list[list[int]]:
    """Token ids of each prompt: a string encoded, a list of token ids as it is (a conversation
    that continues the tokens the model wrote, ``chat/turns.py``)."""
    texts = [p for p in prompts if isinstance(p, str)]
    encoded = iter(tokenizer.encode_batch(texts) if texts else [])
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]


def make_batch(
    tokenizer: BloomTokenizer, prompts: list[str | list[int]], options: GenerationOptions, device: torch.device,
    max_new_tokens_each: list[int] | None = None,
) -> Batch:
    """``max_new_tokens_each``: a budget per prompt, under ``options.max_new_tokens`` and
    ``max_length`` (requests of different lengths in one batch: each row stops at its own)."""
    if not prompts:
        raise InputError("no prompts to generate from")
    if max_new_tokens_each is not None and (
            len(max_new_tokens_each) != len(prompts) or min(max_new_tokens_each) < 1):
        raise InputError(f"max_new_tokens_each needs one budget of at least 1 per prompt ({len(prompts)}), "
                         f"got {max_new_tokens_each}")
    prompt_ids = encode_prompts(tokenizer, prompts)
    prompts = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]
    for i, (text, ids) in enumerate(zip(prompts, prompt_ids)):
        if not ids:
            raise InputError(f"prompt {i + 1} is empty: nothing to continue from")
        if len(ids) >= options.max_length:
            # As transformers: a prompt must leave room for at least one new token.
            raise InputError(
                f"prompt {i + 1} ({_preview(text)}) has {len(ids)} tokens, which leaves no room for new "
                f"tokens under max_length={options.max_length}; raise --max_length to at least {len(ids) + 1}"
            )
    lengths = [len(ids) for ids in prompt_ids]
    room = [options.max_length - n for n in lengths]
    limits = [r if options.max_new_tokens is None else min(r, options.max_new_tokens) for r in room]
    if max_new_tokens_each is not None:
        limits = [min(limit, own) for limit, own in zip(limits, max_new_tokens_each)]
    plan = plan_shapes(lengths, [n + k for n, k in zip(lengths, limits)], options)
    # Padded on the host and made in one piece, a [B, P] tensor whatever the prompt lengths: row by
    # row slice writes would be ops of a new shape for every prompt length (a lazy-mode compile
    # each, where they run on a Gaudi).
    padded = torch.tensor([ids + [tokenizer.pad_token_id] * (plan.prompt_len - len(ids)) for ids in prompt_ids],
                          dtype=torch.long)
    return Batch(
        prompts=list(prompts),
        prompt_ids=prompt_ids,
        input_ids=padded.to(device),
        lengths=torch.tensor(lengths, dtype=torch.long, device=device),
        new_limits=torch.tensor(limits, dtype=torch.long, device=device),
        steps=max(limits),
        plan=plan,
    )


def _preview(text: str, width: int = 40) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= width else flat[: width - 1] + "…")
