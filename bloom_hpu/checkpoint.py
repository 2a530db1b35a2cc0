"""Finding BLOOM checkpoints on disk and reading their tensors, whole or one slice at a time.

A checkpoint is a folder holding config.json, tokenizer.json and the weights in one of four layouts:

    model.safetensors
    model-00001-of-0000N.safetensors ... + model.safetensors.index.json
    pytorch_model.bin
    pytorch_model-00001-of-0000N.bin ... + pytorch_model.bin.index.json

Safetensors is preferred when a folder has both. Tensor names are normalized to the unprefixed
BLOOM names (`h.0.self_attention.dense.weight`, `word_embeddings.weight`, ...): some checkpoints
prefix them with `transformer.`, and some also store `lm_head.weight`, which BLOOM ties to the word
embeddings, so it is dropped.

Reads are lazy and sliceable so that each tensor-parallel rank reads only its own part of a weight.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bloom_hpu.config import BloomConfig

# torch and safetensors are imported where tensors are read, so that finding checkpoints
# (`utils/fetch_weights.py --list`, error messages) does not wait seconds for torch to load.
if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
TOKENIZER = "tokenizer.json"
SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

DEFAULT_ORG = "bigscience"  # bare names like `bloom-560m` are BigScience models
DEFAULT_WEIGHTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEFAULT_MODEL = "bloom-tiny"  # the small trained checkpoint that ships with the repository
FETCH_SCRIPT = "utils/fetch_weights.py"


class CheckpointError(Exception):
    """A checkpoint is missing or unusable. The message is one line meant for the end user."""


def read_json_object(path: Path, error: type[Exception] = CheckpointError) -> dict:
    """The JSON object in ``path`` (a config.json, an adapter_config.json); ``error`` with one line
    naming the file when it cannot be read, is not JSON, or holds something else than an object."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"cannot read {path}: {e}") from None
    except (ValueError, RecursionError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path} must hold a JSON object, got {type(raw).__name__}")
    return raw


# ---------------------------------------------------------------------------------------------
# Names and messages


def split_model_name(model: str) -> tuple[str, str]:
    """`bloom-560m` -> ("bigscience", "bloom-560m"); `org/name` -> ("org", "name")."""
    org, _, name = model.strip().strip("/").rpartition("/")
    return org or DEFAULT_ORG, name


def fetch_command(weights: str | Path, model: str) -> str:
    return f"{FETCH_SCRIPT} --weights {weights} --model {model}"


def _short_list(items, limit: int = 6) -> str:
    # Messages stay on one line even when 72 shards are missing.
    items = list(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


# ---------------------------------------------------------------------------------------------
# Which files hold the weights


@dataclass(frozen=True)
class WeightFiles:
    format: str  # "safetensors" or "bin"
    files: tuple[str, ...]  # file names inside the folder
    weight_map: dict[str, str] | None  # stored tensor name -> file, when there is an index


def _read_index(path: Path) -> dict[str, str]:
    try:
        return json.loads(path.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"index file {path} is unreadable ({type(e).__name__}: {e})") from None


def _weight_layouts(folder: Path) -> list[WeightFiles]:
    """The weight layouts present in `folder`, preferred first. Their files may be missing."""
    layouts = []
    for fmt, single, index in (("safetensors", SAFETENSORS, SAFETENSORS_INDEX), ("bin", BIN, BIN_INDEX)):
        if (folder / index).is_file():
            weight_map = _read_index(folder / index)
            layouts.append(WeightFiles(fmt, tuple(sorted(set(weight_map.values()))), weight_map))
        elif (folder / single).is_file():
            layouts.append(WeightFiles(fmt, (single,), None))
        elif fmt == "safetensors" and (shards := sorted(p.name for p in folder.glob("*.safetensors"))):
            # Safetensors shards without an index still name their tensors in their headers.
            layouts.append(WeightFiles(fmt, tuple(shards), None))
    return layouts


def find_weight_files(folder: str | Path) -> WeightFiles | None:
    """The preferred complete weight layout of `folder`, else the preferred incomplete one."""
    folder = Path(folder)
    layouts = _weight_layouts(folder)
    for layout in layouts:
        if all((folder / f).is_file() for f in layout.files):
            return layout
    return layouts[0] if layouts else None


def missing_files(folder: str | Path) -> list[str]:
    """What `folder` lacks to be a usable checkpoint; empty when complete."""
    folder = Path(folder)
    missing = [f for f in (CONFIG, TOKENIZER) if not (folder / f).is_file()]
    layout = find_weight_files(folder)
    if layout is None:
        missing.append("weight files (model*.safetensors or pytorch_model*.bin)")
    else:
        missing += [f for f in layout.files if not (folder / f).is_file()]
    return missing


def _incomplete(folder: Path, missing: list[str], weights: Path, model: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {folder} is incomplete, missing: {_short_list(missing)}; "
        f"fetch it with: {fetch_command(weights, model)}"
    )


# ---------------------------------------------------------------------------------------------
# Finding a model inside a weights folder


def _looks_like_checkpoint(folder: Path) -> bool:
    # Also true of a half-fetched folder, so that it is reported as incomplete, not as absent.
    names = (CONFIG, TOKENIZER, SAFETENSORS, SAFETENSORS_INDEX, BIN, BIN_INDEX)
    return any((folder / n).is_file() for n in names) or any(folder.glob("*.safetensors"))


def _hf_cache_snapshot(repo_dir: Path) -> Path | None:
    """The snapshot that huggingface_hub's cache (`models--org--name/`) points `main` at."""
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    # No usable ref (e.g. fetched by revision): take the newest snapshot.
    return max((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, default=None)


def _model_folders(weights: Path, model: str) -> list[Path]:
    """Where `model` may live inside `weights`, in order of preference, existing ones only."""
    org, name = split_model_name(model)
    folders = [weights / name, weights / f"{org}--{name}", weights / org / name]
    snapshot = _hf_cache_snapshot(weights / f"models--{org}--{name}")
    if snapshot is not None:
        folders.append(snapshot)
    return [f for f in folders if f.is_dir()]


def find_checkpoints(weights: str | Path) -> dict[str, Path]:
    """The models inside `weights` (complete or not), keyed by the name that selects them."""
    weights = Path(weights)
    found: dict[str, Path] = {}
    if not weights.is_dir():
        return found
    for entry in sorted(weights.iterdir()):
        if not entry.is_dir() or entry.name.startswith("."):
            continue
        if entry.name.startswith("models--"):  # huggingface_hub cache: models--org--name
            snapshot = _hf_cache_snapshot(entry)
            if snapshot is not None:
                found[entry.name.removeprefix("models--").replace("--", "/", 1)] = snapshot
        elif _looks_like_checkpoint(entry):  # <name> or <org>--<name>
            found[entry.name.replace("--", "/", 1)] = entry
        else:  # maybe <org>/<name>
            for sub in sorted(entry.iterdir()):
                if sub.is_dir() and _looks_like_checkpoint(sub):
                    found[f"{entry.name}/{sub.name}"] = sub
    return found


def resolve_checkpoint(weights: str | Path | None, model: str | None) -> Path:
    """The folder holding `model`'s config.json, tokenizer.json and weights.

    `weights` is either a checkpoint folder itself (then `model` is not needed) or a folder of
    models, in which `model` (`bloom-560m`, `bigscience/bloom-7b1`, any `org/name`) is looked up as
    `<name>`, `<org>--<name>`, `<org>/<name>` or huggingface_hub's `models--<org>--<name>` cache.
    `weights=None` means the repository's `checkpoints/` folder, and then `model=None` means the
    embedded `bloom-tiny`. Raises CheckpointError with a one-line, actionable message.
    """
    if weights is None:
        weights, model = DEFAULT_WEIGHTS, model or DEFAULT_MODEL
    root = Path(weights)
    hint_model = model or "bloom-560m"
    if not root.exists():
        raise CheckpointError(
            f"weights folder {root} does not exist; fetch a model into it with: {fetch_command(root, hint_model)}"
        )
    if not root.is_dir():
        raise CheckpointError(f"weights folder {root} is not a folder")

    if (root / CONFIG).is_file():  # a checkpoint folder itself
        missing = missing_files(root)
        if missing:
            raise _incomplete(root, missing, root.parent, model or root.name)
        return root

    if model is None:
        found = find_checkpoints(root)
        if found:
            raise CheckpointError(
                f"weights folder {root} has no config.json; choose one of its models with --model: "
                f"{_short_list(found, limit=20)}"
            )
        raise CheckpointError(
            f"weights folder {root} has no config.json and no models; fetch one with: {fetch_command(root, hint_model)}"
        )

    folders = _model_folders(root, model)
    if not folders:
        found = find_checkpoints(root)
        holds = f"it holds: {_short_list(found, limit=20)}" if found else "it holds no models"
        raise CheckpointError(
            f"model {model} not found in {root} ({holds}); fetch it with: {fetch_command(root, model)}"
        )
    # A complete copy anywhere wins over a half-fetched one earlier in the search order.
    for folder in folders:
        if not missing_files(folder):
            return folder
    raise _incomplete(folders[0], missing_files(folders[0]), root, model)


# ---------------------------------------------------------------------------------------------
# Reading tensors


def expected_names(config: BloomConfig) -> list[str]:
    """The normalized names of every tensor a BLOOM model with `config` loads."""
    names = ["word_embeddings.weight", "word_embeddings_layernorm.weight", "word_embeddings_layernorm.bias"]
    modules = (
        "input_layernorm",
        "self_attention.query_key_value",
        "self_attention.dense",
        "post_attention_layernorm",
        "mlp.dense_h_to_4h",
        "mlp.dense_4h_to_h",
    )
    for i in range(config.n_layer):
        names += [f"h.{i}.{m}.{p}" for m in modules for p in ("weight", "bias")]
    names += ["ln_f.weight", "ln_f.bias"]
    if config.quantization_config is not None:  # int8 weights and their scales in place of the weights
        from .quantize import is_quantized_weight, stored_names

        names = [n for name in names for n in (stored_names(name) if is_quantized_weight(name) else [name])]
    return names


def normalize_name(stored: str) -> str | None:
    """The unprefixed BLOOM name of a stored tensor; None for the tied `lm_head.weight`."""
    if stored == "lm_head.weight":
        return None
    return stored.removeprefix("transformer.")


_SAFETENSORS_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    import torch

    # mmap=True maps the file instead of reading it: slicing a tensor then reads only its pages.
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        # Files written before torch's zip format (torch < 1.6) cannot be mapped; read them whole.
        return torch.load(path, map_location="cpu", weights_only=True)


class CheckpointReader:
    """Lazy, sliceable access to the tensors of one checkpoint folder, by normalized name.

    `bytes_read` counts the bytes (in the stored dtype) of every tensor or slice returned, so tests
    can check that a tensor-parallel rank read only its share.
    """

    def __init__(self, folder: str | Path, config: BloomConfig | None = None):
        self.folder = Path(folder)
        missing = missing_files(self.folder)
        if missing:
            raise _incomplete(self.folder, missing, self.folder.parent, self.folder.name)
        self.config = config or BloomConfig.from_json(self.folder / CONFIG)
        self.layout = find_weight_files(self.folder)
        self.bytes_read = 0
        self.has_lm_head = False
        self._handles: dict[str, object] = {}  # file -> safe_open handle or mmap'd state dict
        self._where: dict[str, tuple[str, str]] = {}  # normalized name -> (file, stored name)

        for stored, file in self._stored_names():
            name = normalize_name(stored)
            if name is None:
                self.has_lm_head = True
            else:
                self._where[name] = (file, stored)

        absent = [n for n in expected_names(self.config) if n not in self._where]
        if absent:
            raise CheckpointError(
                f"checkpoint {self.folder} lacks {len(absent)} tensors its config.json needs: {_short_list(absent)}"
            )

    def _stored_names(self):
        if self.layout.weight_map is not None:  # the index names them without opening a shard
            yield from self.layout.weight_map.items()
            return
        for file in self.layout.files:
            handle = self._open(file)
            for stored in handle.keys():
                yield stored, file

    def _open(self, file: str):
        if file not in self._handles:
            path = self.folder / file
            try:
                if self.layout.format == "safetensors":
                    from safetensors import safe_open

                    self._handles[file] = safe_open(str(path), framework="pt")
                else:
                    self._handles[file] = _load_bin(path)
            except Exception as e:
                reason = (str(e).strip().splitlines() or [""])[0]
                raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {reason})") from None
        return self._handles[file]

    def _locate(self, name: str) -> tuple[object, str]:
        if name not in self._where:
            raise CheckpointError(f"checkpoint {self.folder} has no tensor {name}")
        file, stored = self._where[name]
        return self._open(file), stored

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        handle, stored = self._locate(name)
        if self.layout.format == "safetensors":
            return tuple(handle.get_slice(stored).get_shape())
        return tuple(handle[stored].shape)

    def stored_dtype(self, name: str) -> torch.dtype:
        import torch

        handle, stored = self._locate(name)
        if self.layout.format == "safetensors":
            return getattr(torch, _SAFETENSORS_DTYPES[handle.get_slice(stored).get_dtype()])
        return handle[stored].dtype

    def get(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        rows: slice | None = None,
        cols: slice | None = None,
    ) -> torch.Tensor:
        """Tensor `name`, or its `[rows, cols]` slice, reading only that slice from disk.

        The result is a contiguous CPU tensor that owns its memory (never a view of the file).
        """
        import torch

        handle, stored = self._locate(name)
        if cols is not None and len(self.shape(name)) < 2:
            raise ValueError(f"{name} has one dimension; it has no columns to slice")
        index = (rows or slice(None),) if cols is None else (rows or slice(None), cols)
        sliced = rows is not None or cols is not None

        if self.layout.format == "safetensors":
            # get_slice copies only the slice out of the file (a column slice comes back strided).
            tensor = handle.get_slice(stored)[index] if sliced else handle.get_tensor(stored)
            self.bytes_read += tensor.numel() * tensor.element_size()
            return tensor.to(dtype or tensor.dtype).contiguous()

        # .bin: indexing the mmap'd tensor is a view; copying it touches only the slice's pages.
        view = handle[stored][index] if sliced else handle[stored]
        tensor = torch.empty(view.shape, dtype=dtype or view.dtype)
        tensor.copy_(view)
        self.bytes_read += view.numel() * view.element_size()
        return tensor

    def close(self) -> None:
        # Dropping the handles unmaps the files.
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
