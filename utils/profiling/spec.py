"""The model a profile runs: a BLOOM name, a checkpoint's config.json, or a spec file (JSON or YAML).

Only the shape matters (the weights are random, drawn in memory on each rank), so a spec holds
``n_layer``, ``hidden_size``, ``n_head`` and ``vocab_size`` (transformers' aliases such as
``num_hidden_layers`` are read too), and optionally ``max_length``: the longest sequence (prompt
plus new tokens) the model is meant for. BLOOM was trained on sequences of 2048 tokens, the default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from bloom_hpu.config import BloomConfig

# The shapes of the published BLOOM models (their config.json): vocab, hidden, layers, heads.
BLOOM_SHAPES = {
    "bloom-560m": (250880, 1024, 24, 16),
    "bloom-1b1": (250880, 1536, 24, 16),
    "bloom-1b7": (250880, 2048, 24, 16),
    "bloom-3b": (250880, 2560, 30, 32),
    "bloom-7b1": (250880, 4096, 30, 32),
    "bloom": (250880, 14336, 70, 112),
}
DEFAULT_MAX_LENGTH = 2048  # BLOOM's training sequence length
SPEC_KEYS = ("n_layer", "hidden_size", "n_head", "vocab_size")


class SpecError(ValueError):
    """A model argument the profiler cannot use; the message says why."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what the user gave: a BLOOM name or a file's name
    n_layer: int
    hidden_size: int
    n_head: int
    vocab_size: int
    max_length: int = DEFAULT_MAX_LENGTH
    tokenizer_dir: str | None = None  # a checkpoint folder whose tokenizer to use (config.json beside it)

    def config(self) -> BloomConfig:
        return BloomConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size, n_layer=self.n_layer,
                           n_head=self.n_head)

    def parameters(self) -> int:
        """Weights of the model: embeddings (tied LM head), 2 LayerNorms, and per layer
        QKV + dense + MLP with biases and 2 LayerNorms."""
        h = self.hidden_size
        per_layer = (3 * h * h + 3 * h) + (h * h + h) + (4 * h * h + 4 * h) + (4 * h * h + h) + 4 * h
        return self.vocab_size * h + 4 * h + self.n_layer * per_layer

    def shape(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "tokenizer_dir"}


def _read_mapping(path: Path) -> dict:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise SpecError(f"{path} is not valid YAML ({str(error).splitlines()[0]})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise SpecError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(data, dict):
        raise SpecError(f"{path} must hold a mapping with keys {', '.join(SPEC_KEYS)}")
    return data


def load_spec(model: str) -> ModelSpec:
    """A BLOOM name, a config.json (or the folder holding one), or a JSON/YAML spec file."""
    if model in BLOOM_SHAPES:
        vocab, hidden, layers, heads = BLOOM_SHAPES[model]
        return ModelSpec(model, layers, hidden, heads, vocab)
    path = Path(model)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(f"unknown model {model!r}: give a BLOOM name ({', '.join(BLOOM_SHAPES)}), a checkpoint's "
                        "config.json, or a spec file (JSON or YAML) with n_layer, hidden_size, n_head, vocab_size")
    data = _read_mapping(path)
    try:
        config = BloomConfig.from_json(data)  # reads transformers' aliases and checks heads divide hidden
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as error:
        raise SpecError(f"{path}: {error}") from None
    values = {"n_layer": config.n_layer, "hidden_size": config.hidden_size, "n_head": config.n_head,
              "vocab_size": config.vocab_size,
              "max_length": data.get("max_length", data.get("seq_length", DEFAULT_MAX_LENGTH))}
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise SpecError(f"{path}: {key} must be a positive integer, got {value!r}")
    tokenizer_dir = str(path.parent) if (path.parent / "tokenizer.json").is_file() else None
    return ModelSpec(path.name, tokenizer_dir=tokenizer_dir, **values)
