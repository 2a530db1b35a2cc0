"""A checkpoint of a BLOOM model's first N blocks: its embeddings, blocks 0 .. N-1 and final
LayerNorm, its tokenizer, its config.json with ``n_layer`` N.

What it is for: a draft model for speculative decoding (``--speculate draft --draft_model DIR``)
that agrees with its target by construction, where no trained smaller model of the same vocabulary
is at hand (random test weights, a benchmark of the draft's cost). The tests and
``bench/speculate_bench.py`` make their drafts with it. A trained model's first layers alone guess
poorly; a real draft is a smaller model of the family (bloom-560m for bloom-7b1).

    python utils/first_layers.py SRC OUT --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository's packages on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bloom_hpu.checkpoint import CheckpointError, CheckpointReader, expected_names, read_json_object  # noqa: E402
from bloom_hpu.config import BloomConfig  # noqa: E402
from utils.random_checkpoint import copy_tokenizer, write_weights  # noqa: E402

LAYER_KEYS = ("n_layer", "num_hidden_layers")  # config.json's names for the number of blocks


def first_layers(src: str | Path, out: str | Path, layers: int) -> Path:
    """Writes the checkpoint of ``src``'s first ``layers`` blocks into ``out``; returns ``out``."""
    src, out = Path(src), Path(out)
    raw = read_json_object(src / "config.json")
    config = BloomConfig.from_json(raw)
    if not 1 <= layers <= config.n_layer:
        raise ValueError(f"layers must be from 1 to {config.n_layer} (the blocks of {src}), got {layers}")
    for key in LAYER_KEYS:
        if key in raw:
            raw[key] = layers
    raw.setdefault("n_layer", layers)
    kept = BloomConfig.from_json(raw)
    with CheckpointReader(src, config) as reader:
        tensors = {name: reader.get(name) for name in expected_names(kept)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(src, out)
    write_weights(out, tensors, "safetensors")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a BLOOM checkpoint folder")
    parser.add_argument("out", help="the folder to write the smaller checkpoint into")
    parser.add_argument("--layers", type=int, required=True, help="how many of the first blocks to keep")
    args = parser.parse_args(argv)
    try:
        first_layers(args.src, args.out, args.layers)
    except (CheckpointError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: the first {args.layers} blocks of {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
