"""The embedded checkpoints/bloom-tiny: loadable by transformers, BLOOM-like, reproducible."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from bloom_hpu.checkpoint import CheckpointReader, missing_files
from bloom_hpu.config import BloomConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "utils" / "make_default_checkpoint.py"
FILES = ["README.md", "config.json", "model.safetensors"]
FILES += ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    model, info = transformers.BloomForCausalLM.from_pretrained(tiny_checkpoint, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_is_small_and_complete(tiny_checkpoint):
    assert sorted(p.name for p in tiny_checkpoint.iterdir()) == FILES
    assert not missing_files(tiny_checkpoint)
    assert sum(p.stat().st_size for p in tiny_checkpoint.iterdir()) < 4_000_000
    assert "random" in (tiny_checkpoint / "README.md").read_text()


def test_reader_and_config(tiny_checkpoint):
    config = BloomConfig.from_json(tiny_checkpoint)
    assert (config.vocab_size, config.hidden_size, config.n_layer, config.n_head) == (1024, 128, 3, 8)
    with CheckpointReader(tiny_checkpoint) as reader:
        assert reader.shape("word_embeddings.weight") == (1024, 128)
        assert reader.stored_dtype("ln_f.weight") == torch.float32


def test_tokenizer_behaves_like_blooms(tokenizer):
    assert type(tokenizer).__name__ == "BloomTokenizerFast"
    t = tokenizer
    assert [t.unk_token_id, t.bos_token_id, t.eos_token_id, t.pad_token_id] == [0, 1, 2, 3]
    assert tokenizer.padding_side == "left"
    assert len(tokenizer) <= 1024  # the model's (padded) vocabulary covers the tokenizer's
    text = "The river ran fast. Ünïcödé, emoji 🙂 and\ttabs\n  double  spaces"
    ids = tokenizer(text).input_ids
    assert 1 not in ids and 2 not in ids  # no BOS/EOS added
    assert tokenizer.decode(ids) == text  # byte-level: any text round-trips
    assert tokenizer(" the").input_ids != tokenizer("the").input_ids  # no prefix space added
    batch = tokenizer(["a", "The morning was cold"], padding=True).input_ids
    assert batch[0][0] == 3 and batch[1][0] != 3  # padded on the left


def test_transformers_greedy_text_depends_on_the_prompt(hf_model, tokenizer):
    prompts = ["The morning was cold", "Hello world", "A ship", "Why is the sky blue?"]
    outputs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = hf_model(ids).logits
            out = hf_model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=3)
        assert torch.isfinite(logits).all()
        top2 = logits[0, -1].topk(2).values
        assert top2[0] - top2[1] > 1e-3  # peaky enough that float noise cannot flip the argmax
        outputs.append(out[0, ids.shape[1] :].tolist())
    assert len({tuple(o) for o in outputs}) == len(prompts)
    assert all(len(set(o)) >= 3 for o in outputs)  # not one token repeated
    assert all(t < len(tokenizer) for o in outputs for t in o)  # padded vocabulary rows are never chosen


def test_script_regenerates_identical_files(tiny_checkpoint, tmp_path):
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], check=True, capture_output=True, timeout=120)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (tiny_checkpoint / name).read_bytes(), name
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 1024
