"""A byte-level BPE tokenizer that behaves like BLOOM's, trained on a given text.

Used by utils/make_default_checkpoint.py (on the corpus the default model learns from) and by
utils/random_checkpoint.py (on utils/tiny_corpus.txt, the fixed tokenizer of the random test
checkpoints).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

# BLOOM's special tokens, at BLOOM's ids (unk=0, bos=1, eos=2, pad=3).
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_tokenizer(lines: Iterable[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer that behaves like BLOOM's, trained on `lines`."""
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
    tokenizer.train_from_iterator(lines, trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """tokenizer.json plus the two files that make transformers load it as BloomTokenizerFast."""
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
