"""Everything the user gives is checked here, at the edge, before any work or memory is taken.

- ``check_checkpoint``: config.json (types, ranges, ``model_type``) and the tokenizer, each error
  naming the file;
- ``check_against_model``: options that the model's vocabulary bounds (beams, top_k);
- ``check_prompts``: every prompt before the first batch runs, numbered as the user numbers them;
- ``check_memory``: the KV cache and step buffers a call would allocate, against what the device
  has free (see ``generation/request/memory.py`` for the arithmetic);
- ``check_request``: one request line against the model and the memory (a line that fails here
  gets an error record; the job goes on);
- ``check_call``: argument types of the library's ``generate`` / ``stream``, named at the call.

Options' own types and ranges live with the options (``options.GenerationOptions.validate``).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from bloom_hpu.checkpoint import CheckpointError, read_json_object

from ..run.batch import InputError
from .memory import MemoryCheckError, agreed_free_bytes, estimate_bytes, human
from .options import GenerationOptions, OptionError, valid_seed
from .parse import batch_length

# config.json fields: (type, smallest value). bool is refused where an int is wanted.
_CONFIG_INTS = {"vocab_size": 1, "hidden_size": 1, "n_layer": 1, "n_head": 1,
                "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
_ALIASES = {"hidden_size": ("hidden_size", "n_embed"), "n_layer": ("n_layer", "num_hidden_layers"),
            "n_head": ("n_head", "num_attention_heads")}
MAX_CONFIG_SIZE = 1 << 40  # no BLOOM has a dimension near this; bigger numbers are a broken file


def check_checkpoint(folder: str | Path) -> dict:
    """The checkpoint's config.json, checked; CheckpointError names the file and the field."""
    path = Path(folder) / "config.json"
    raw = read_json_object(path)
    model_type = raw.get("model_type", "bloom")
    if model_type != "bloom":
        raise CheckpointError(f"{path}: model_type is {model_type!r}; this program runs BLOOM models only")
    values = {}
    for name, low in _CONFIG_INTS.items():
        for key in _ALIASES.get(name, (name,)):
            if raw.get(key) is not None:
                value = raw[key]
                if isinstance(value, bool) or not isinstance(value, int):
                    raise CheckpointError(f"{path}: {key} must be an integer, got {value!r}")
                if not low <= value <= MAX_CONFIG_SIZE:
                    raise CheckpointError(f"{path}: {key} must be between {low} and {MAX_CONFIG_SIZE}, got {value}")
                values[name] = value
                break
        else:
            if name in ("vocab_size", "hidden_size", "n_layer", "n_head"):
                raise CheckpointError(f"{path} lacks {name}")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if values.get(name, 0) >= values["vocab_size"]:
            raise CheckpointError(f"{path}: {name} {values[name]} is outside the vocabulary (vocab_size "
                                  f"{values['vocab_size']})")
    if values["hidden_size"] % values["n_head"]:
        raise CheckpointError(f"{path}: hidden_size {values['hidden_size']} is not a multiple of "
                              f"n_head {values['n_head']}")
    eps = raw.get("layer_norm_epsilon", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (0 < eps < 1):
        raise CheckpointError(f"{path}: layer_norm_epsilon must be a number in (0, 1), got {eps!r}")
    flag = raw.get("apply_residual_connection_post_layernorm", False)
    if not isinstance(flag, bool):
        raise CheckpointError(f"{path}: apply_residual_connection_post_layernorm must be true or false, got {flag!r}")
    return raw


def load_tokenizer(folder: str | Path, config):
    """The checkpoint's tokenizer; a broken tokenizer.json is a CheckpointError naming it."""
    from ..run.batch import BloomTokenizer

    try:
        tokenizer = BloomTokenizer(folder, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    except Exception as error:  # noqa: BLE001 - tokenizers raises plain Exceptions for bad files
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"cannot load the tokenizer of {folder} (tokenizer.json or tokenizer_config.json): "
                              f"{message}") from None
    if tokenizer.vocab_size > config.vocab_size:
        # Ids the embedding has no row for would fail deep inside the first step.
        raise CheckpointError(f"{Path(folder) / 'tokenizer.json'} has {tokenizer.vocab_size} tokens, more than "
                              f"config.json's vocab_size {config.vocab_size}")
    return tokenizer


def check_against_model(opts: GenerationOptions, vocab_size: int) -> None:
    """Options the vocabulary bounds: beam search keeps 2 x num_beams candidates per step."""
    if opts.num_beams > 1 and 2 * opts.num_beams > vocab_size:
        raise OptionError(f"num_beams must be at most {vocab_size // 2} for this model (beam search takes "
                          f"2 x num_beams candidates among {vocab_size} tokens), got {opts.num_beams}")
    if opts.top_k > vocab_size:
        raise OptionError(f"top_k must be at most the vocabulary size {vocab_size}, got {opts.top_k}")


def check_prompts(tokenizer, prompts: list[str], opts: GenerationOptions) -> list[list[int]]:
    """Every prompt, numbered from 1 over the whole list, before the first batch runs."""
    for i, p in enumerate(prompts, 1):
        if not isinstance(p, str):
            raise InputError(f"prompt {i} must be a string, got {type(p).__name__}")
        try:
            p.encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"prompt {i} holds characters that are not valid Unicode text "
                             "(a lone surrogate, or bytes that were not UTF-8)") from None
    ids = tokenizer.encode_batch(list(prompts))
    for i, (p, row) in enumerate(zip(prompts, ids), 1):
        if not row:
            raise InputError(f"prompt {i} is empty: nothing to continue from")
        if len(row) >= opts.max_length:
            raise InputError(f"prompt {i} has {len(row)} tokens, which leaves no room for new tokens under "
                             f"max_length={opts.max_length}; raise --max_length to at least {len(row) + 1}")
    return ids


def rows_per_prompt(opts: GenerationOptions) -> int:
    return max(opts.num_beams, opts.num_return_sequences if opts.do_sample else 1)


def check_memory(config, dtype: torch.dtype, device: torch.device, rows: int, length: int, prompt_len: int,
                 parallel=None, what: str = "--batch_size, --max_length, num_beams or "
                 "num_return_sequences", extra: int = 0) -> None:
    """Refuse before allocating when the cache and buffers of a call cannot fit the free memory
    (under tensor parallelism: a rank's share, against the least free memory of the ranks).
    ``extra``: bytes the caller keeps besides (captured graphs' outputs)."""
    world_size = parallel.world_size if parallel is not None else 1
    need = estimate_bytes(config, dtype, rows, length, prompt_len, world_size) + extra
    free = agreed_free_bytes(device, parallel)
    if free is not None and need > free:
        raise MemoryCheckError(f"this needs about {human(need)} of memory on {device.type} for {rows} rows of "
                               f"{length} tokens, but {human(free)} is free; lower {what}")


def check_request(generator, request, prompt_lengths: list[int]) -> None:
    """One request line against the model and the memory (see ``requests.py`` for the request's
    own checks)."""
    check_against_model(request.to_options(), generator.model.config.vocab_size)
    length = batch_length(max(prompt_lengths), request.max_tokens)
    rows = len(request.prompts) * request.rows_per_prompt
    check_memory(generator.model.config, generator.dtype, generator.device, rows, length, max(prompt_lengths),
                 generator.model.parallel, what="max_tokens, n, best_of or num_beams, or the prompt")


def check_call(prompts, options, on_step, max_new_tokens_each, seed_each=None) -> list[str]:
    """The library's arguments, named at the call rather than failing deep inside."""
    if isinstance(prompts, str):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)):
        prompts = list(prompts)
    else:
        raise TypeError(f"prompts must be a string or a list of prompts, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            if min(p) < 0:
                raise InputError(f"prompts[{i}]: token ids are at least 0, got {min(p)}")
            prompts[i] = list(p)
        elif not isinstance(p, str):
            one = " (one prompt of token ids is [[id, ...]])" if isinstance(p, int) else ""
            raise TypeError(f"prompts[{i}] must be a string or a non-empty list of token ids, "
                            f"got {type(p).__name__}{one}")
    if options is not None and not isinstance(options, (str, GenerationOptions)):
        raise TypeError(f"options must be a GenerationOptions, an options string or None, got {type(options).__name__}")
    if on_step is not None and not callable(on_step):
        raise TypeError(f"on_step must be callable, got {type(on_step).__name__}")
    if max_new_tokens_each is not None:
        if not isinstance(max_new_tokens_each, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) for n in max_new_tokens_each):
            raise TypeError("max_new_tokens_each must be a list of integers, one per prompt, "
                            f"got {max_new_tokens_each!r}")
    if seed_each is not None:
        if not isinstance(seed_each, (list, tuple)) or not all(
                s is None or (isinstance(s, int) and not isinstance(s, bool)) for s in seed_each):
            raise TypeError(f"seed_each must be a list of integers or None, one per prompt, got {seed_each!r}")
        if len(seed_each) != len(prompts):
            raise InputError(f"seed_each needs one seed (or None) per prompt ({len(prompts)}), got {len(seed_each)}")
        if not all(valid_seed(s) for s in seed_each):
            raise InputError(f"seed_each: each seed must be >= 0 (and below 2**63), got {seed_each!r}")
    return prompts


def check_dtype(dtype) -> None:
    if isinstance(dtype, torch.dtype) and dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be fp32, bf16 or fp16 (or the torch float dtypes), got {dtype}")
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be 'fp32', 'bf16', 'fp16' or a torch dtype, got {type(dtype).__name__}")


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
