#!/usr/bin/env python3
"""Creates checkpoints/bloom-tiny: the small random BLOOM checkpoint that ships with the repository.

It lets the CLI and the tests run with no download: a byte-level BPE tokenizer trained here on
utils/tiny_corpus.txt (a few KB of English written for this purpose) with BLOOM's special tokens
and behavior, and random weights from utils/random_checkpoint.py. Its output is not meaningful
text, only deterministic: running this script again gives byte-identical files.

    utils/make_default_checkpoint.py [--out checkpoints/bloom-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run as a script, utils/ is on sys.path but the repo root is not

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from utils.random_checkpoint import make_random_checkpoint  # noqa: E402

CORPUS = REPO_ROOT / "utils" / "tiny_corpus.txt"
DEFAULT_OUT = REPO_ROOT / "checkpoints" / "bloom-tiny"

# BLOOM's special tokens, at BLOOM's ids (unk=0, bos=1, eos=2, pad=3).
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
TOKENIZER_VOCAB = 1000  # the model pads it to 1024, as BLOOM pads 250680 to 250880
MODEL = dict(hidden_size=128, n_layer=3, n_head=8, seed=0)

README = """\
# bloom-tiny: a random BLOOM checkpoint for tests and demos

Not a real model: its weights are random, so it generates gibberish (deterministically). It exists
so that `bloom.py` and the test suite run without downloading anything.

- architecture: BLOOM, hidden size {hidden_size}, {n_layer} layers, {n_head} heads, vocabulary {vocab_size}
  ({live_vocab} tokenizer tokens, padded as BLOOM pads its vocabulary)
- tokenizer: byte-level BPE trained on `utils/tiny_corpus.txt`, with BLOOM's special tokens
  `<unk>`=0, `<s>`=1, `</s>`=2, `<pad>`=3 and BLOOM's pre-tokenizer; encodes any text
- weights: float32 safetensors, loadable by `transformers.BloomForCausalLM.from_pretrained`

Made by `utils/make_default_checkpoint.py`; running it again gives byte-identical files.
For real weights use `utils/fetch_weights.py`.
"""


def train_tokenizer(corpus: Path, vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer that behaves like BLOOM's."""
    tokenizer = Tokenizer(models.BPE())
    # BLOOM splits on whitespace and a few punctuation marks (a space stays glued to the word
    # after it), then maps bytes to printable characters, with no prefix space added.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?[^(\s|[.,!?…。，、।۔،])]+"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # No post-processor: BLOOM adds no BOS/EOS when encoding.
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # added first, so they get ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes: no unknown text
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.read_text().splitlines(keepends=True), trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    tokenizer_config = {
        "tokenizer_class": "BloomTokenizerFast",
        **special,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        # Batched prompts are padded on the left so that every row ends at the same position.
        "padding_side": "left",
    }
    for name, content in (("tokenizer_config.json", tokenizer_config), ("special_tokens_map.json", special)):
        (out / name).write_text(json.dumps(content, indent=2) + "\n")


def make_default_checkpoint(out_dir: str | Path = DEFAULT_OUT) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(CORPUS, TOKENIZER_VOCAB)
    write_tokenizer(tokenizer, out)
    make_random_checkpoint(out, fmt="safetensors", tokenizer_from=out, **MODEL)
    config = json.loads((out / "config.json").read_text())
    sizes = {k: config[k] for k in ("hidden_size", "n_layer", "n_head", "vocab_size")}
    (out / "README.md").write_text(README.format(live_vocab=tokenizer.get_vocab_size(), **sizes))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder to write (default: %(default)s)")
    args = parser.parse_args(argv)
    out = make_default_checkpoint(args.out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
