#!/usr/bin/env python3
"""Write an int8 or int4 copy of a BLOOM checkpoint, so a large model loads quantized from disk instead
of being quantized at every start:
``utils/quantize_checkpoint.py --weights DIR [--model NAME] [--quantize int4 [--group_size G]] --out DIR``.

The weights of the linear layers and the word embeddings are stored as ``<module>.qweight`` (int8,
or int4 packed two to a byte) and ``<module>.scales`` (fp32, one per output row, or one per group
of G weights of a row: ``bloom_hpu/quantize.py``, ``bloom_hpu/int4.py``); the layer norms and
biases as they were. It reads and writes one tensor at a time, one safetensors shard per block
(``model-00001-of-000NN.safetensors`` with its index), so its memory is a block's, not the model's.
``config.json`` gains ``quantization_config`` (the key transformers uses); the tokenizer files
are copied. ``./bloom.py --weights OUT …`` then loads it quantized on one process or many (int4 with
as many ranks as G divides each rank's part of a row).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bloom_hpu.checkpoint import CheckpointError, CheckpointReader, resolve_checkpoint  # noqa: E402
from bloom_hpu.config import BloomConfig  # noqa: E402
from bloom_hpu import int4  # noqa: E402
from bloom_hpu.quantize import (MODES, QuantizeError, is_quantized_weight, quantization_config,  # noqa: E402
                                quantize_weight, resolve_group_size, stored_names)

WEIGHT_FILES = re.compile(r"(model.*\.safetensors|pytorch_model.*\.bin|.*\.index\.json)$")


def block_of(name: str) -> int:
    """Shard number: 0 for the embeddings and final norm, i + 1 for block i."""
    match = re.match(r"h\.(\d+)\.", name)
    return int(match.group(1)) + 1 if match else 0


def quantize_checkpoint(source: Path, out: Path, mode: str = "int8", group_size: int | None = None) -> int:
    """Write ``out``; returns the bytes of the quantized checkpoint's tensors."""
    from safetensors.torch import save_file

    config_raw = json.loads((source / "config.json").read_text())
    config = BloomConfig.from_json(config_raw)
    if config.quantization_config is not None:
        raise QuantizeError(f"{source} is quantized already ({config.quantization_config.get('quant_method')!r})")
    group_size = resolve_group_size(mode, group_size)
    if group_size is not None:  # a GroupSizeError is a ValueError: main prints it in one line
        int4.check_group_size(group_size, {"the embeddings and layers": config.hidden_size,
                                           "dense_4h_to_h": 4 * config.hidden_size})
    out.mkdir(parents=True, exist_ok=True)
    if any(out.iterdir()):
        raise QuantizeError(f"{out} is not empty; give a new folder")
    shards = config.n_layer + 1
    names: dict[int, list[str]] = {}
    with CheckpointReader(source, config) as reader:
        for name in reader.names():
            names.setdefault(block_of(name), []).append(name)
        weight_map, total = {}, 0
        for shard in range(shards):
            tensors = {}
            for name in names.get(shard, []):
                tensor = reader.get(name)
                if is_quantized_weight(name):
                    qname, sname = stored_names(name)
                    tensors[qname], tensors[sname] = quantize_weight(tensor, group_size)
                else:
                    tensors[name] = tensor.contiguous()
            file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
            save_file(tensors, str(out / file), metadata={"format": "pt"})
            weight_map.update({n: file for n in tensors})
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
    config_raw["quantization_config"] = quantization_config(mode, group_size)
    (out / "config.json").write_text(json.dumps(config_raw, indent=2) + "\n")
    for item in source.iterdir():  # the tokenizer and the rest, not the float weights
        if item.is_file() and item.name != "config.json" and not WEIGHT_FILES.match(item.name):
            shutil.copy2(item, out / item.name)
    return total


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", required=True, help="a checkpoint folder, or a folder holding --model")
    p.add_argument("--model", help="the checkpoint's name inside --weights (bloom-7b1, ...)")
    p.add_argument("--out", required=True, help="a new folder for the quantized checkpoint")
    p.add_argument("--quantize", default="int8", choices=MODES, help="int8 (default): a scale per output row; "
                   "int4: a scale per --group_size weights of a row")
    p.add_argument("--group_size", type=int, metavar="G", help="with --quantize int4: 32, 64 (default), 128 or 256")
    args = p.parse_args(argv)
    try:
        source = resolve_checkpoint(args.weights, args.model)
        total = quantize_checkpoint(Path(source), Path(args.out), args.quantize, args.group_size)
    except (CheckpointError, QuantizeError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {total / 2**20:.1f} MB of {args.quantize} weights, scales, norms and biases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
