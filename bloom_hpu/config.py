"""The BLOOM hyper-parameters, read from and written to a transformers `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Real BLOOM configs spell some fields in more than one way (bloom-560m writes `n_embed` in
# old revisions and `hidden_size` in new ones, bloom writes `num_attention_heads`); each of
# our fields lists every spelling we accept, the canonical (transformers) one first.
_ALIASES = {
    "hidden_size": ("hidden_size", "n_embed"),
    "n_layer": ("n_layer", "num_hidden_layers"),
    "n_head": ("n_head", "num_attention_heads"),
}


@dataclass
class BloomConfig:
    vocab_size: int
    hidden_size: int
    n_layer: int
    n_head: int
    layer_norm_epsilon: float = 1e-5
    apply_residual_connection_post_layernorm: bool = False
    bos_token_id: int = 1
    eos_token_id: int = 2
    pad_token_id: int = 3
    # Set when the checkpoint's weights are stored quantized (bloom_hpu/quantize.py, the key
    # transformers uses); None: float weights.
    quantization_config: dict | None = None

    def __post_init__(self):
        if self.hidden_size % self.n_head:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of n_head {self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_head

    @classmethod
    def from_json(cls, path_or_dict: str | Path | dict[str, Any]) -> BloomConfig:
        """Reads a transformers BLOOM config: a dict, a config.json file, or a folder holding one.

        Keys we do not use (dropout, `pretraining_tp`, ...) are ignored.
        """
        if isinstance(path_or_dict, dict):
            raw = path_or_dict
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            raw = json.loads(path.read_text())

        kwargs = {}
        for f in fields(cls):
            for key in _ALIASES.get(f.name, (f.name,)):
                # A present-but-null token id (some configs have "pad_token_id": null) means
                # "not set": keep our default rather than storing None.
                if raw.get(key) is not None:
                    kwargs[f.name] = raw[key]
                    break
        missing = [name for name in ("vocab_size", "hidden_size", "n_layer", "n_head") if name not in kwargs]
        if missing:
            raise ValueError(f"BLOOM config lacks {', '.join(missing)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """A transformers-compatible config: `transformers.BloomConfig(**d)` accepts it."""
        d: dict[str, Any] = {"architectures": ["BloomForCausalLM"], "model_type": "bloom"}
        d.update({f.name: getattr(self, f.name) for f in fields(self)})
        if d["quantization_config"] is None:  # float weights: transformers expects no key at all
            del d["quantization_config"]
        # The LM head shares the word embeddings in every BLOOM checkpoint.
        d["tie_word_embeddings"] = True
        d["unk_token_id"] = 0
        return d

    def save(self, path: str | Path) -> None:
        """Writes config.json into a folder (or to the given .json path)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
