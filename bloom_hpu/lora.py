"""LoRA adapters in the format PEFT saves them: read, check against the base model, merge.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or
``adapter_model.bin``). For every adapted linear ``W [out, in]`` it stores ``lora_A [r, in]`` and
``lora_B [out, r]`` under the name of the module inside transformers' ``BloomForCausalLM``, e.g.
``base_model.model.transformer.h.0.self_attention.query_key_value.lora_A.weight``. The adapted
linear computes ``x W^T + scale * (x A^T) B^T`` with ``scale = alpha / r`` (``alpha / sqrt(r)``
with ``use_rslora``), ``r`` and ``alpha`` per module from ``rank_pattern`` / ``alpha_pattern``.

Merged once at load, that is ``W += scale * B @ A`` (done in fp32, then cast to the run's dtype).
Under tensor parallelism a rank holds rows (column-parallel) or columns (row-parallel) of ``W``,
and ``(B @ A)[rows, cols] = B[rows] @ A[:, cols]``: each rank merges its own slice only.

``fan_in_fan_out`` describes weights stored ``[in, out]`` (GPT-2's Conv1D). BLOOM's linears are
``nn.Linear`` (``[out, in]``), for which PEFT itself turns the flag off (with a warning) and
merges ``B @ A`` untransposed; so do we, so an adapter gives the same model as under PEFT.

Every check that needs only the config (module names, layer numbers, shapes, ranks) runs in
``read_adapter``, before any weight of the base model is read.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .checkpoint import read_json_object
from .config import BloomConfig

CONFIG = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")

# The linears of a BLOOM block that an adapter may target, and their (out, in) in hidden sizes.
MODULES = {
    "self_attention.query_key_value": (3, 1),
    "self_attention.dense": (1, 1),
    "mlp.dense_h_to_4h": (4, 1),
    "mlp.dense_4h_to_h": (1, 4),
}
TARGET_NAMES = sorted({m.rsplit(".", 1)[1] for m in MODULES})  # as target_modules names them

# PEFT features that change what the adapter computes and that a plain merge cannot express.
_UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}

# base_model.model.transformer.h.N.<module>.lora_(A|B)[.<adapter name>].weight
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:transformer\.)?h\.(\d+)\."
    r"(self_attention\.query_key_value|self_attention\.dense|mlp\.dense_h_to_4h|mlp\.dense_4h_to_h)"
    r"\.lora_([AB])(?:\.[A-Za-z0-9_-]+)?\.weight$"
)


class LoraError(ValueError):
    """An adapter is missing, broken or unsupported. The message is one line for the user."""


@dataclass
class LoraPair:
    """One adapted linear: ``W += scale * B @ A``; A [r, in], B [out, r], both fp32 on the CPU."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    def delta(self, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """scale * (B @ A)[rows, cols], computed from the slices only (a rank's share)."""
        b = self.b if rows is None else self.b[rows]
        a = self.a if cols is None else self.a[:, cols]
        return self.scale * (b @ a)


@dataclass
class LoraAdapter:
    folder: Path
    pairs: dict[str, LoraPair] = field(default_factory=dict)  # "h.N.<module>.weight" -> pair

    def __contains__(self, name: str) -> bool:
        return name in self.pairs

    @property
    def max_rank(self) -> int:
        return max(p.rank for p in self.pairs.values())

    def merge(self, name: str, weight: torch.Tensor, rows: slice | None = None,
              cols: slice | None = None) -> torch.Tensor:
        """``weight`` (this rank's [rows, cols] slice of checkpoint tensor ``name``) plus the
        adapter's update of that slice, summed in fp32 and returned in ``weight``'s dtype."""
        pair = self.pairs.get(name)
        if pair is None:
            return weight
        return (weight.float() + pair.delta(rows, cols)).to(weight.dtype)

    def describe(self) -> str:
        ranks = sorted({p.rank for p in self.pairs.values()})
        modules = sorted({n.split(".", 2)[2].rsplit(".", 1)[0] for n in self.pairs})
        return (f"LoRA adapter {self.folder}: {len(self.pairs)} linears ({', '.join(modules)}), "
                f"rank {'/'.join(map(str, ranks))}")


# --- reading and checking -------------------------------------------------------------------------


def read_adapter(folder: str | Path, config: BloomConfig) -> LoraAdapter:
    """Read a PEFT LoRA folder and check it against the base model's ``config``; LoraError if it
    cannot be merged exactly."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise LoraError(f"{folder} is a file, not an adapter folder (give the folder PEFT's save_pretrained wrote)")
    if not folder.is_dir():
        raise LoraError(f"adapter folder {folder} does not exist")
    settings = _read_config(folder)
    tensors = _read_weights(folder)
    return LoraAdapter(folder, _pairs(folder, settings, tensors, config))


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    if not path.is_file():
        raise LoraError(f"adapter folder {folder} has no {CONFIG} (is it a PEFT adapter, saved with save_pretrained?)")
    raw = read_json_object(path, LoraError)

    peft_type = raw.get("peft_type")
    if peft_type != "LORA":
        raise LoraError(f"{path}: peft_type is {peft_type!r}; only LORA adapters are supported")
    if raw.get("bias", "none") != "none":
        raise LoraError(f"{path}: bias is {raw['bias']!r}; only adapters with bias \"none\" are supported "
                        "(trained biases are not part of the LoRA weights)")
    if raw.get("modules_to_save"):
        raise LoraError(f"{path}: modules_to_save {raw['modules_to_save']!r} is not supported "
                        "(the adapter replaces whole modules; only LoRA updates can be merged)")
    for key, what in _UNSUPPORTED_FLAGS.items():
        if raw.get(key):
            raise LoraError(f"{path}: {what} is not supported")

    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoraError(f"{path}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise LoraError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = raw.get(key) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in pattern.values()
        ):
            raise LoraError(f"{path}: {key} must map module names to positive numbers, got {pattern!r}")
        raw[key] = pattern

    targets = raw.get("target_modules")
    if isinstance(targets, str):
        try:
            re.compile(targets)
        except re.error as error:
            raise LoraError(f"{path}: target_modules {targets!r} is not a valid regular expression ({error})") from None
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in TARGET_NAMES]
        if unknown:
            raise LoraError(f"{path}: target_modules {', '.join(map(repr, unknown))} not supported; "
                            f"BLOOM adapters may target {', '.join(TARGET_NAMES)}")
    else:
        raise LoraError(f"{path}: target_modules must be a list of module names or a regular expression, "
                        f"got {targets!r}")
    layers = raw.get("layers_to_transform")
    if layers is not None and not (isinstance(layers, int) or (isinstance(layers, list)
                                                              and all(isinstance(i, int) for i in layers))):
        raise LoraError(f"{path}: layers_to_transform must be a layer number or a list of them, got {layers!r}")
    return raw


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            break
    else:
        raise LoraError(f"adapter folder {folder} has no {' or '.join(WEIGHT_FILES)}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors = load_file(str(path))
        else:
            tensors = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: any reader error means "broken"
        reason = (str(error).strip().splitlines() or [""])[0]
        raise LoraError(f"cannot read {path} ({type(error).__name__}: {reason})") from None
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise LoraError(f"{path} does not hold a dictionary of tensors")
    return tensors


def _targeted(settings: dict, module_key: str, layer: int) -> bool:
    """Whether the config targets ``module_key`` (e.g. ``transformer.h.3.mlp.dense_h_to_4h``), as
    PEFT decides it: a string is a regular expression the whole name must match, a list names
    modules by their last parts; ``layers_to_transform`` keeps only the listed layers."""
    targets = settings["target_modules"]
    if isinstance(targets, str):
        return re.fullmatch(targets, module_key) is not None
    if not any(module_key == t or module_key.endswith("." + t) for t in targets):
        return False
    layers = settings.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    return layer in ([layers] if isinstance(layers, int) else layers)


def _pattern_value(pattern: dict, module_key: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the name."""
    for key in pattern:
        if re.match(rf"(.*\.)?({key})$", module_key):
            return pattern[key]
    return default


def _pairs(folder: Path, settings: dict, tensors: dict[str, torch.Tensor], config: BloomConfig) -> dict[str, LoraPair]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraError(f"adapter {folder}: tensor {key} is not a LoRA weight of a BLOOM linear "
                            f"({', '.join(TARGET_NAMES)}); such adapters are not supported")
        layer, module, half = int(match[1]), match[2], match[3]
        if half in halves.setdefault((layer, module), {}):
            raise LoraError(f"adapter {folder}: two lora_{half} tensors for h.{layer}.{module}")
        halves[(layer, module)][half] = tensor
    if not halves:
        raise LoraError(f"adapter {folder} holds no LoRA weights")

    h = config.hidden_size
    pairs = {}
    for (layer, module), ab in sorted(halves.items()):
        where = f"adapter {folder}: h.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoraError(f"{where} has lora_{''.join(ab)} but no lora_{'B' if 'A' in ab else 'A'}")
        if layer >= config.n_layer:
            raise LoraError(f"{where}: the base model has {config.n_layer} layers (h.0 to h.{config.n_layer - 1}); "
                            "was the adapter trained on another model?")
        module_key = f"transformer.h.{layer}.{module}"
        if not _targeted(settings, module_key, layer):
            raise LoraError(f"{where} has weights but adapter_config.json does not target it "
                            f"(target_modules {settings['target_modules']!r})")
        a, b = ab["A"], ab["B"]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoraError(f"{where}: lora weights must be floating point, got {a.dtype} and {b.dtype}")
        out_mult, in_mult = MODULES[module]
        r = _pattern_value(settings["rank_pattern"], module_key, settings["r"])
        want_a, want_b = (r, in_mult * h), (out_mult * h, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoraError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                            f"model, which needs {want_a} and {want_b} (hidden size {h}, rank {r}); "
                            "was the adapter trained on another model?")
        alpha = _pattern_value(settings["alpha_pattern"], module_key, settings["lora_alpha"])
        scale = alpha / math.sqrt(r) if settings.get("use_rslora") else alpha / r
        pairs[f"h.{layer}.{module}.weight"] = LoraPair(a.float(), b.float(), float(scale))
    return pairs
