"""Writes BLOOM checkpoints with random weights, loadable by transformers and by bloom_hpu.

Tests compare our model with transformers on such checkpoints, so the weights are drawn to make
those comparisons meaningful:

- every sub-layer matters: linear weights have std 1/sqrt(fan_in), so attention and MLP outputs are
  about as large as their inputs, and the output projections get a gain of 2 so that context, not
  the current token alone, drives the next token;
- no echo: with tied embeddings an untrained model repeats its last token forever, because the
  residual stream carries that token's embedding and the LM head (the same matrix) scores it highest
  (trained BLOOM learns not to). The embedding LayerNorm's weight is near -1 instead of 1, so the
  echo lowers that token's logit; greedy text then varies with the prompt;
- logits are peaky: the word embeddings, which are also the LM head, get std
  `weight_scale / sqrt(hidden_size)`, so logits spread with std about `weight_scale`. With the
  default 10 the top token's probability is about 0.9 (median), and its lead over the second is
  about 2 (median), some 10^5 times the float32 discrepancy between two evaluations, so float noise
  cannot flip an argmax in practice;
- padded vocabulary rows (BLOOM pads its vocabulary past the tokenizer's) are zero, so their logit
  is 0 and they are practically never generated, like in the real, trained models.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from bloom_hpu.checkpoint import BIN, BIN_INDEX, SAFETENSORS, SAFETENSORS_INDEX, expected_names
from bloom_hpu.config import BloomConfig
from utils.bloom_tokenizer import TOKENIZER_FILES, train_tokenizer, write_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
# The test checkpoints' tokenizer: trained on a few KB of English written for this purpose, with
# 1000 tokens (a vocabulary of 1024 once padded). It is fixed here rather than copied from the
# default checkpoint, so that retraining the default model never changes a test checkpoint.
TEST_CORPUS = REPO_ROOT / "utils" / "tiny_corpus.txt"
TEST_TOKENIZER_VOCAB = 1000
FORMATS = ("safetensors", "safetensors-sharded", "bin", "bin-sharded")

DEFAULT_WEIGHT_SCALE = 10.0  # std of the logits; see the module docstring
_NOISE = 0.1  # std of the noise on LayerNorm weights and of every bias
_OUT_GAIN = 2.0  # extra gain of the attention and MLP output projections
_VOCAB_MULTIPLE = 128  # BLOOM pads its vocabulary to a multiple of 128 (250680 -> 250880)


# The products' shapes in multiples of hidden_size: (out, in).
_LINEAR = {"query_key_value": (3, 1), "dense": (1, 1), "dense_h_to_4h": (4, 1), "dense_4h_to_h": (1, 4)}


def tensor_shape(name: str, config: BloomConfig) -> tuple[int, ...]:
    """The shape of weight ``name`` (a normalized BLOOM name) in a model of ``config``."""
    h = config.hidden_size
    module, kind = name.rsplit(".", 1)
    if name == "word_embeddings.weight":
        return config.vocab_size, h
    if module.endswith(("layernorm", "ln_f")):
        return (h,)
    n_out, n_in = _LINEAR[module.rsplit(".", 1)[1]]
    return (n_out * h,) if kind == "bias" else (n_out * h, n_in * h)


def recipe_std(name: str, config: BloomConfig, weight_scale: float) -> float:
    """The standard deviation of weight ``name``'s random part (see the module docstring)."""
    module, kind = name.rsplit(".", 1)
    if name == "word_embeddings.weight":
        return weight_scale / math.sqrt(config.hidden_size)
    if module.endswith(("layernorm", "ln_f")) or kind == "bias":
        return _NOISE
    gain = _OUT_GAIN if module.endswith(("self_attention.dense", "dense_4h_to_h")) else 1.0
    return gain / math.sqrt(tensor_shape(name, config)[1])


def finish_recipe(name: str, tensor: torch.Tensor, *, live_vocab: int, start: int = 0) -> torch.Tensor:
    """The recipe's fixed parts, in place, on rows ``start ...`` of ``name`` drawn with std
    ``recipe_std``: padded vocabulary rows zero, LayerNorm weights around 1 (-1 for the embeddings')."""
    module, kind = name.rsplit(".", 1)
    if name == "word_embeddings.weight":
        tensor[max(live_vocab - start, 0):] = 0  # padded vocabulary rows (see the docstring)
    elif module.endswith(("layernorm", "ln_f")) and kind == "weight":
        tensor.add_(1)
        if module == "word_embeddings_layernorm":
            tensor.neg_()  # no echo of the current token (see the docstring)
    return tensor


def random_tensor(name: str, config: BloomConfig, *, live_vocab: int, weight_scale: float,
                  gen: torch.Generator) -> torch.Tensor:
    """One float32 weight of the recipe (see the module docstring), drawn from ``gen``.

    ``random_weights`` draws every tensor from one generator in ``expected_names`` order; the
    profiler (utils/profiling/random_model.py) takes the same std and fixed parts, from a pool."""
    tensor = torch.randn(tensor_shape(name, config), generator=gen, device=gen.device)
    tensor.mul_(recipe_std(name, config, weight_scale))  # in place: one pass less
    return finish_recipe(name, tensor, live_vocab=live_vocab)


def random_weights(config: BloomConfig, *, live_vocab: int, seed: int, weight_scale: float) -> dict[str, torch.Tensor]:
    """Random float32 weights under the normalized BLOOM names, in `expected_names` order."""
    gen = torch.Generator().manual_seed(seed)
    return {name: random_tensor(name, config, live_vocab=live_vocab, weight_scale=weight_scale, gen=gen)
            for name in expected_names(config)}


def _tokenizer_vocab_size(folder: Path) -> int:
    return Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


@functools.cache
def _test_tokenizer_json() -> str:
    lines = TEST_CORPUS.read_text().splitlines(keepends=True)
    return train_tokenizer(lines, TEST_TOKENIZER_VOCAB).to_str()


def write_test_tokenizer(out: Path) -> None:
    """The test checkpoints' tokenizer (trained once per process, in milliseconds) into `out`."""
    write_tokenizer(Tokenizer.from_str(_test_tokenizer_json()), out)


def copy_tokenizer(src: Path, out: Path) -> None:
    if src.resolve() == out.resolve():
        return
    if not (src / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{src} has no tokenizer.json")
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def _shards(names: list[str], n: int) -> list[list[str]]:
    """`names` cut into `n` contiguous runs of about equal count."""
    n = max(1, min(n, len(names)))
    bounds = [round(i * len(names) / n) for i in range(n + 1)]
    return [names[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def write_weights(out: Path, tensors: dict[str, torch.Tensor], fmt: str, num_shards: int = 2) -> None:
    """Writes `tensors` in one of FORMATS, with the index file transformers reads when sharded."""
    # Weight files of an earlier run in another format would shadow or confuse the new ones.
    for pattern in ("*.safetensors", "pytorch_model*.bin", "*.index.json"):
        for stale in out.glob(pattern):
            stale.unlink()

    safetensors = fmt.startswith("safetensors")
    single, index = (SAFETENSORS, SAFETENSORS_INDEX) if safetensors else (BIN, BIN_INDEX)

    def save(part: dict[str, torch.Tensor], file: str) -> None:
        # Contiguous, unshared copies: safetensors refuses tensors that share memory.
        part = {k: v.contiguous().clone() for k, v in part.items()}
        if safetensors:
            save_file(part, out / file, metadata={"format": "pt"})
        else:
            torch.save(part, out / file)

    if not fmt.endswith("-sharded"):
        save(tensors, single)
        return
    stem, ext = single.split(".")
    groups = _shards(list(tensors), num_shards)
    weight_map = {}
    for i, group in enumerate(groups, 1):
        file = f"{stem}-{i:05d}-of-{len(groups):05d}.{ext}"
        save({k: tensors[k] for k in group}, file)
        weight_map |= {k: file for k in group}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / index).write_text(json.dumps(index_json, indent=2) + "\n")


def make_random_checkpoint(
    out_dir: str | Path,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    seed: int = 0,
    weight_scale: float = DEFAULT_WEIGHT_SCALE,
    fmt: str = "safetensors",
    prefixed: bool = False,
    tokenizer_from: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 2,
) -> Path:
    """Writes config.json, the tokenizer files and random weights into `out_dir`; returns it.

    vocab_size: defaults to the tokenizer's vocabulary rounded up to a multiple of 128, as BLOOM
        pads it; it may not be smaller than the tokenizer's.
    fmt: one of FORMATS. prefixed: store `transformer.`-prefixed names plus a (tied) `lm_head.weight`,
        like checkpoints saved from BloomForCausalLM, instead of the unprefixed BloomModel names.
    tokenizer_from: a folder to copy the tokenizer files from; default: the test tokenizer
        (`write_test_tokenizer`).
    dtype: the stored dtype; the values are drawn in float32 first, so one seed gives the same
        weights (up to rounding) in every dtype.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {', '.join(FORMATS)}, not {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    if tokenizer_from is None:
        write_test_tokenizer(out)
    else:
        copy_tokenizer(Path(tokenizer_from), out)
    live_vocab = _tokenizer_vocab_size(out)
    if vocab_size is None:
        vocab_size = -(-live_vocab // _VOCAB_MULTIPLE) * _VOCAB_MULTIPLE
    if vocab_size < live_vocab:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's vocabulary ({live_vocab})")

    config = BloomConfig(vocab_size=vocab_size, hidden_size=hidden_size, n_layer=n_layer, n_head=n_head)
    config.save(out)

    weights = random_weights(config, live_vocab=live_vocab, seed=seed, weight_scale=weight_scale)
    weights = {k: v.to(dtype) for k, v in weights.items()}
    if prefixed:
        weights = {f"transformer.{k}": v for k, v in weights.items()}
        weights["lm_head.weight"] = weights["transformer.word_embeddings.weight"]
    write_weights(out, weights, fmt, num_shards)
    return out
