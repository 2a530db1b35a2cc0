"""utils/fetch_weights.py with the Hub replaced by fakes, plus one real (offline) failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.utils import filter_repo_objects

from bloom_hpu.checkpoint import resolve_checkpoint
from utils import fetch_weights
from utils.fetch_weights import CONFIG_FILES

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "utils" / "fetch_weights.py"
SMALL = dict(hidden_size=32, n_layer=1, n_head=4)

REPO_FILES = {  # what a BLOOM repo on the Hub holds, with sizes
    ".gitattributes": 1_000,
    "README.md": 20_000,
    "config.json": 700,
    "tokenizer.json": 14_500_000,
    "tokenizer_config.json": 200,
    "special_tokens_map.json": 100,
    "model.safetensors": 1_100_000_000,
    "pytorch_model.bin": 1_100_000_000,
    "flax_model.msgpack": 1_100_000_000,
    "onnx/decoder_model.onnx": 2_000_000,
}


@pytest.mark.parametrize(
    "env",
    [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}],
    ids=["offline", "unreachable"],
)
def test_unreachable_hub_is_one_line_and_exit_1(tmp_path, env):
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--weights", str(tmp_path), "--model", "bloom-560m"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: cannot reach the Hugging Face Hub to fetch bigscience/bloom-560m: ")


class FakeHub:
    """Stands in for the two Hub calls; `download` writes a checkpoint copied from `source`."""

    def __init__(self, monkeypatch, source, files=REPO_FILES):
        self.source, self.files, self.downloads = source, files, []
        monkeypatch.setattr(fetch_weights, "hub_files", self.hub_files)
        monkeypatch.setattr(fetch_weights, "hub_download", self.hub_download)

    def hub_files(self, repo_id):
        if repo_id.startswith("nobody/"):
            raise RepositoryNotFoundError(
                f"404 Client Error. Repository Not Found for url: https://huggingface.co/api/models/{repo_id}"
            )
        return self.files

    def hub_download(self, repo_id, local_dir, allow_patterns):
        self.downloads.append((repo_id, local_dir, allow_patterns))
        shutil.copytree(self.source, local_dir, dirs_exist_ok=True)


def test_fetch_picks_safetensors_and_a_layout_resolve_finds(make_ckpt, tmp_path, monkeypatch, capsys):
    hub = FakeHub(monkeypatch, make_ckpt(**SMALL))
    assert fetch_weights.main(["--weights", str(tmp_path), "--model", "bloom-560m"]) == 0
    [(repo_id, local_dir, patterns)] = hub.downloads
    assert (repo_id, local_dir) == ("bigscience/bloom-560m", tmp_path / "bloom-560m")
    chosen = set(filter_repo_objects(REPO_FILES, allow_patterns=patterns))  # the Hub client's own matching
    assert chosen == {"model.safetensors", *CONFIG_FILES}
    assert resolve_checkpoint(tmp_path, "bloom-560m") == local_dir
    assert "bigscience/bloom-560m (1.1 GB)" in capsys.readouterr().out


def test_fetch_falls_back_to_bin(make_ckpt, tmp_path, monkeypatch):
    names = ["config.json", "tokenizer.json", "flax_model.msgpack", "pytorch_model.bin.index.json"]
    names += ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]
    files = dict.fromkeys(names, 1)
    hub = FakeHub(monkeypatch, make_ckpt(fmt="bin-sharded", **SMALL), files)
    assert fetch_weights.main(["--weights", str(tmp_path), "--model", "someone/my-bloom"]) == 0
    [(repo_id, local_dir, patterns)] = hub.downloads
    assert (repo_id, local_dir) == ("someone/my-bloom", tmp_path / "my-bloom")
    assert set(filter_repo_objects(files, allow_patterns=patterns)) == set(files) - {"flax_model.msgpack"}
    assert resolve_checkpoint(tmp_path, "someone/my-bloom") == local_dir


def test_fetch_defaults_to_every_known_model(make_ckpt, tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch, make_ckpt(**SMALL))
    assert fetch_weights.main(["--weights", str(tmp_path)]) == 0
    assert [d[0] for d in hub.downloads] == [f"bigscience/{m}" for m in fetch_weights.KNOWN_MODELS]
    assert [d[1].name for d in hub.downloads] == list(fetch_weights.KNOWN_MODELS)


def test_fetch_unknown_repo_is_one_line(make_ckpt, tmp_path, monkeypatch, capsys):
    FakeHub(monkeypatch, make_ckpt(**SMALL))
    assert fetch_weights.main(["--weights", str(tmp_path), "--model", "nobody/nothing"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no model nobody/nothing on the Hugging Face Hub")


def test_fetch_reports_a_download_that_is_not_a_checkpoint(tmp_path, monkeypatch, capsys):
    source = tmp_path / "not-bloom"
    source.mkdir()
    (source / "config.json").write_text("{}")
    FakeHub(monkeypatch, source)
    assert fetch_weights.main(["--weights", str(tmp_path / "w"), "--model", "bloom-560m"]) == 1
    assert "lacks tokenizer.json, weight files" in capsys.readouterr().err


def test_list_shows_models_sizes_and_completeness(make_ckpt, tmp_path, capsys):
    shutil.copytree(make_ckpt(**SMALL), tmp_path / "bloom-560m")
    half = shutil.copytree(make_ckpt(fmt="safetensors-sharded", **SMALL), tmp_path / "bigscience--bloom-7b1")
    (half / "model-00002-of-00002.safetensors").unlink()
    assert fetch_weights.main(["--weights", str(tmp_path), "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("bigscience/bloom-7b1")
    assert "incomplete (missing model-00002-of-00002.safetensors)" in lines[0]
    assert lines[1].startswith("bloom-560m") and "complete" in lines[1] and "incomplete" not in lines[1]
    size = sum(f.stat().st_size for f in (tmp_path / "bloom-560m").iterdir())
    assert fetch_weights.human_size(size) in lines[1] and " KB" in lines[1]


def test_list_errors(tmp_path, capsys):
    assert fetch_weights.main(["--weights", str(tmp_path), "--list"]) == 0
    assert capsys.readouterr().out.strip() == f"no models in {tmp_path}"
    assert fetch_weights.main(["--weights", str(tmp_path / "nowhere"), "--list"]) == 1
    assert capsys.readouterr().err.strip() == f"error: weights folder {tmp_path / 'nowhere'} does not exist"


def test_human_size():
    sizes = (999, 1_100_000_000, 352_000_000_000_000)
    assert [fetch_weights.human_size(n) for n in sizes] == ["999 B", "1.1 GB", "352.0 TB"]
