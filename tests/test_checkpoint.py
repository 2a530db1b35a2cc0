"""Config parsing, checkpoint discovery (layouts and errors) and tensor reading (formats, slices)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bloom_hpu.checkpoint import (
    DEFAULT_WEIGHTS,
    CheckpointError,
    CheckpointReader,
    expected_names,
    find_checkpoints,
    resolve_checkpoint,
)
from bloom_hpu.config import BloomConfig
from utils.random_checkpoint import FORMATS, random_weights

SMALL = dict(hidden_size=32, n_layer=2, n_head=4)  # small enough to copy around freely

# ---------------------------------------------------------------------------------------------
# config


def test_config_reads_every_spelling_and_ignores_unknown_keys():
    old = {"vocab_size": 250880, "n_embed": 14336, "num_hidden_layers": 70, "num_attention_heads": 112,
           "pad_token_id": None, "slow_but_exact": False, "pretraining_tp": 4, "n_inner": None}  # fmt: skip
    cfg = BloomConfig.from_json(old)
    assert (cfg.hidden_size, cfg.n_layer, cfg.n_head, cfg.head_dim) == (14336, 70, 112, 128)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.layer_norm_epsilon) == (3, 2, 1e-5)
    new = {"vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16, "layer_norm_epsilon": 1e-6}
    assert BloomConfig.from_json(new) == BloomConfig(250880, 1024, 24, 16, layer_norm_epsilon=1e-6)


def test_config_from_file_and_folder(tmp_path):
    cfg = BloomConfig(vocab_size=1024, hidden_size=64, n_layer=2, n_head=4)
    cfg.save(tmp_path)
    assert BloomConfig.from_json(tmp_path) == cfg
    assert BloomConfig.from_json(str(tmp_path / "config.json")) == cfg
    with pytest.raises(ValueError, match="n_head"):
        BloomConfig.from_json({"vocab_size": 1, "hidden_size": 8, "n_layer": 1})


def test_config_to_dict_is_a_transformers_config():
    cfg = BloomConfig(1024, 96, n_layer=3, n_head=6, apply_residual_connection_post_layernorm=True)
    d = cfg.to_dict()
    assert d["model_type"] == "bloom" and d["architectures"] == ["BloomForCausalLM"]
    hf = transformers.BloomConfig(**d)
    assert (hf.vocab_size, hf.hidden_size, hf.n_layer, hf.n_head) == (1024, 96, 3, 6)
    assert hf.apply_residual_connection_post_layernorm and hf.tie_word_embeddings
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (1, 2, 3)
    assert BloomConfig.from_json(hf.to_dict()) == cfg


# ---------------------------------------------------------------------------------------------
# reading every format


def written_weights(folder, seed=0):
    """What make_random_checkpoint wrote into `folder`, recomputed from its seed."""
    cfg = BloomConfig.from_json(folder)
    live = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    return random_weights(cfg, live_vocab=live, seed=seed, weight_scale=10.0)


@pytest.mark.parametrize("prefixed", [False, True], ids=["unprefixed", "prefixed"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_reader_reads_back_every_format(make_ckpt, fmt, prefixed):
    folder = make_ckpt(fmt=fmt, prefixed=prefixed, **SMALL)
    if fmt.endswith("-sharded"):
        index = "model.safetensors.index.json" if fmt.startswith("safetensors") else "pytorch_model.bin.index.json"
        weight_map = json.loads((folder / index).read_text())["weight_map"]
        assert len(set(weight_map.values())) == 2
        assert all(k.startswith("transformer.") or k == "lm_head.weight" for k in weight_map) == prefixed

    expected = written_weights(folder)
    with CheckpointReader(folder) as reader:
        assert sorted(reader.names()) == sorted(expected_names(reader.config)) == sorted(expected)
        assert reader.has_lm_head == prefixed
        assert "lm_head.weight" not in reader
        for name, tensor in expected.items():
            assert reader.shape(name) == tuple(tensor.shape)
            assert torch.equal(reader.get(name), tensor), name
        assert reader.bytes_read == sum(t.numel() * 4 for t in expected.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_transformers_loads_every_format(make_ckpt, fmt):
    folder = make_ckpt(fmt=fmt, **SMALL)
    model, info = transformers.BloomForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()
    assert torch.equal(model.lm_head.weight, written_weights(folder)["word_embeddings.weight"])


def test_safetensors_preferred_over_bin(make_ckpt, tmp_path):
    folder = tmp_path / "both"
    shutil.copytree(make_ckpt(fmt="bin", **SMALL), folder)
    tensors = load_file(make_ckpt(fmt="safetensors", seed=1, **SMALL) / "model.safetensors")
    save_file(tensors, folder / "model.safetensors")
    with CheckpointReader(folder) as reader:
        assert reader.layout.format == "safetensors"
        assert torch.equal(reader.get("ln_f.bias"), tensors["ln_f.bias"])


# ---------------------------------------------------------------------------------------------
# slices and dtypes


@pytest.mark.parametrize("fmt", ["safetensors-sharded", "bin"])
def test_slices_read_only_the_slice(make_ckpt, fmt):
    folder = make_ckpt(fmt=fmt, **SMALL)
    qkv, bias = "h.1.self_attention.query_key_value.weight", "h.1.self_attention.query_key_value.bias"
    with CheckpointReader(folder) as reader:
        full, full_bias = reader.get(qkv), reader.get(bias)
        reader.bytes_read = 0

        rows = reader.get(qkv, rows=slice(16, 48))
        assert torch.equal(rows, full[16:48]) and rows.is_contiguous()
        assert reader.bytes_read == 32 * 32 * 4

        cols = reader.get(qkv, cols=slice(8, 16))
        assert torch.equal(cols, full[:, 8:16]) and cols.is_contiguous()
        both = reader.get(qkv, rows=slice(0, 3), cols=slice(30, 32))
        assert torch.equal(both, full[0:3, 30:32])
        assert torch.equal(reader.get(bias, rows=slice(90, 96)), full_bias[90:96])
        assert reader.bytes_read == (32 * 32 + 96 * 8 + 3 * 2 + 6) * 4

        half = reader.get(qkv, dtype=torch.bfloat16, rows=slice(0, 8))
        assert half.dtype == torch.bfloat16 and torch.equal(half, full[:8].to(torch.bfloat16))
        with pytest.raises(ValueError):
            reader.get(bias, cols=slice(0, 2))


def test_bin_files_are_mapped_not_read(make_ckpt, monkeypatch, tmp_path):
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw) or real_load(*a, **kw))
    with CheckpointReader(make_ckpt(fmt="bin-sharded", **SMALL)) as reader:
        reader.get("ln_f.weight")
    assert calls and all(kw["mmap"] and kw["weights_only"] for kw in calls)

    # Files from before torch's zip format cannot be mapped: read whole instead.
    folder = place(make_ckpt(fmt="bin", **SMALL), tmp_path / "legacy")
    tensors = real_load(folder / "pytorch_model.bin")
    torch.save(tensors, folder / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    with CheckpointReader(folder) as reader:
        assert torch.equal(reader.get("ln_f.bias"), tensors["ln_f.bias"])


def test_returned_tensors_own_their_memory(make_ckpt):
    # A view of the mmap'd .bin file would change the file, or fail, when written to.
    with CheckpointReader(make_ckpt(fmt="bin", **SMALL)) as reader:
        t = reader.get("ln_f.weight")
        t.zero_()
        assert not torch.equal(reader.get("ln_f.weight"), t)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_stored_dtype_and_conversion(make_ckpt, fmt):
    folder = make_ckpt(fmt=fmt, dtype=torch.float16, **SMALL)
    expected = written_weights(folder)["h.0.mlp.dense_4h_to_h.weight"].to(torch.float16)
    with CheckpointReader(folder) as reader:
        assert reader.stored_dtype("h.0.mlp.dense_4h_to_h.weight") == torch.float16
        assert torch.equal(reader.get("h.0.mlp.dense_4h_to_h.weight"), expected)
        assert torch.equal(reader.get("h.0.mlp.dense_4h_to_h.weight", dtype=torch.float32), expected.float())
        reader.bytes_read = 0
        reader.get("h.0.mlp.dense_4h_to_h.weight", dtype=torch.float32)
        assert reader.bytes_read == 32 * 128 * 2  # counted in the stored dtype


# ---------------------------------------------------------------------------------------------
# finding a model in a weights folder


@pytest.fixture
def ckpt(make_ckpt):
    return make_ckpt(**SMALL)


def place(src, dst):
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    "layout", ["bloom-560m", "bigscience--bloom-560m", "bigscience/bloom-560m"], ids=["name", "org--name", "org/name"]
)
@pytest.mark.parametrize("model", ["bloom-560m", "bigscience/bloom-560m"])
def test_resolve_plain_layouts(ckpt, tmp_path, layout, model):
    folder = place(ckpt, tmp_path / layout)
    assert resolve_checkpoint(tmp_path, model) == folder
    assert resolve_checkpoint(str(tmp_path), model) == folder


def test_resolve_other_orgs(ckpt, tmp_path):
    place(ckpt, tmp_path / "bigscience--bloomz-560m")
    folder = place(ckpt, tmp_path / "someone--bloomz-560m")
    assert resolve_checkpoint(tmp_path, "someone/bloomz-560m") == folder


def hf_cache_repo(ckpt, weights, repo="bigscience/bloom-560m", snapshots=("aaa", "bbb"), main=None):
    """The layout huggingface_hub's cache writes: files as symlinks into blobs/."""
    repo_dir = weights / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True)
    for i, commit in enumerate(snapshots):
        snap = repo_dir / "snapshots" / commit
        snap.mkdir(parents=True)
        for f in ckpt.iterdir():
            blob = repo_dir / "blobs" / f"{commit}-{f.name}"
            shutil.copyfile(f, blob)
            (snap / f.name).symlink_to(os.path.relpath(blob, snap))
        os.utime(snap, (time.time() + i * 10, time.time() + i * 10))  # later snapshots are newer
    if main is not None:
        (repo_dir / "refs").mkdir()
        (repo_dir / "refs" / "main").write_text(main)
    return repo_dir


def test_resolve_hf_cache_follows_refs_main(ckpt, tmp_path):
    repo_dir = hf_cache_repo(ckpt, tmp_path, main="aaa")
    assert resolve_checkpoint(tmp_path, "bloom-560m") == repo_dir / "snapshots" / "aaa"
    assert resolve_checkpoint(tmp_path, "bigscience/bloom-560m") == repo_dir / "snapshots" / "aaa"
    with CheckpointReader(resolve_checkpoint(tmp_path, "bloom-560m")) as reader:
        assert reader.get("ln_f.weight").shape == (32,)


def test_resolve_hf_cache_without_ref_takes_newest_snapshot(ckpt, tmp_path):
    repo_dir = hf_cache_repo(ckpt, tmp_path, snapshots=("old", "new"))
    assert resolve_checkpoint(tmp_path, "bloom-560m") == repo_dir / "snapshots" / "new"


def test_resolve_weights_folder_that_is_a_checkpoint(ckpt):
    assert resolve_checkpoint(ckpt, None) == ckpt
    assert resolve_checkpoint(ckpt, "bloom-7b1") == ckpt  # the folder itself wins


def test_resolve_prefers_a_complete_copy(ckpt, tmp_path):
    half = place(ckpt, tmp_path / "bloom-560m")
    (half / "model.safetensors").unlink()
    full = place(ckpt, tmp_path / "bigscience" / "bloom-560m")
    assert resolve_checkpoint(tmp_path, "bloom-560m") == full


def test_resolve_default_is_the_embedded_checkpoint():
    assert resolve_checkpoint(None, None) == DEFAULT_WEIGHTS / "bloom-tiny"


def test_find_checkpoints_names_every_layout(ckpt, tmp_path):
    place(ckpt, tmp_path / "bloom-560m")
    place(ckpt, tmp_path / "bigscience--bloom-1b1")
    place(ckpt, tmp_path / "someone" / "my-bloom")
    hf_cache_repo(ckpt, tmp_path, repo="bigscience/bloom-7b1", snapshots=("abc",), main="abc")
    (tmp_path / "notes").mkdir()
    found = find_checkpoints(tmp_path)
    assert sorted(found) == ["bigscience/bloom-1b1", "bigscience/bloom-7b1", "bloom-560m", "someone/my-bloom"]
    for name in found:
        assert resolve_checkpoint(tmp_path, name) == found[name]


# ---------------------------------------------------------------------------------------------
# errors: one line each, saying what is wrong and what to run


def error_of(weights, model):
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(weights, model)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_error_weights_folder_missing(tmp_path):
    message = error_of(tmp_path / "nowhere", "bloom-560m")
    assert "does not exist" in message
    assert f"utils/fetch_weights.py --weights {tmp_path / 'nowhere'} --model bloom-560m" in message


def test_error_no_model_given_lists_the_models(ckpt, tmp_path):
    place(ckpt, tmp_path / "bloom-560m")
    place(ckpt, tmp_path / "bigscience--bloom-7b1")
    message = error_of(tmp_path, None)
    assert "has no config.json" in message and "--model" in message
    assert "bloom-560m" in message and "bigscience/bloom-7b1" in message


def test_error_no_model_given_empty_folder(tmp_path):
    message = error_of(tmp_path, None)
    assert "no models" in message and f"utils/fetch_weights.py --weights {tmp_path} --model bloom-560m" in message


def test_error_model_not_found(ckpt, tmp_path):
    place(ckpt, tmp_path / "bloom-560m")
    message = error_of(tmp_path, "bigscience/bloom-7b1")
    assert "model bigscience/bloom-7b1 not found" in message
    assert "bloom-560m" in message  # what is there
    assert f"utils/fetch_weights.py --weights {tmp_path} --model bigscience/bloom-7b1" in message


def test_error_incomplete_lists_exactly_what_is_missing(make_ckpt, tmp_path):
    folder = place(make_ckpt(fmt="bin-sharded", **SMALL), tmp_path / "bloom-560m")
    (folder / "tokenizer.json").unlink()
    (folder / "pytorch_model-00002-of-00002.bin").unlink()
    message = error_of(tmp_path, "bloom-560m")
    assert "incomplete" in message
    assert "missing: tokenizer.json, pytorch_model-00002-of-00002.bin;" in message
    assert "config.json" not in message and "00001" not in message
    assert f"utils/fetch_weights.py --weights {tmp_path} --model bloom-560m" in message


def test_error_incomplete_no_weights_no_config(ckpt, tmp_path):
    folder = place(ckpt, tmp_path / "bloom-560m")
    (folder / "model.safetensors").unlink()
    (folder / "config.json").unlink()
    message = error_of(tmp_path, "bloom-560m")
    assert "missing: config.json, weight files" in message


def test_error_checkpoint_folder_itself_incomplete(ckpt, tmp_path):
    folder = place(ckpt, tmp_path / "bloom-560m")
    (folder / "model.safetensors").unlink()
    message = error_of(folder, None)
    assert "weight files" in message and f"--weights {tmp_path} --model bloom-560m" in message


def test_error_missing_tensors_are_named(ckpt, tmp_path):
    folder = place(ckpt, tmp_path / "bloom-560m")
    tensors = load_file(folder / "model.safetensors")
    del tensors["ln_f.bias"], tensors["h.1.mlp.dense_4h_to_h.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lacks 2 tensors .*: h\.1\.mlp\.dense_4h_to_h\.weight, ln_f\.bias$"):
        CheckpointReader(folder)


def test_error_unknown_tensor_and_bad_index(make_ckpt, tmp_path):
    with CheckpointReader(make_ckpt(**SMALL)) as reader:
        with pytest.raises(CheckpointError, match="no tensor lm_head.weight"):
            reader.get("lm_head.weight")
    folder = place(make_ckpt(fmt="safetensors-sharded", **SMALL), tmp_path / "bloom-560m")
    (folder / "model.safetensors.index.json").write_text("{not json")
    assert "unreadable" in error_of(tmp_path, "bloom-560m")
