"""LoRA adapters merged at load, against PEFT's own ``PeftModel`` on transformers' BLOOM.

Adapters are made by PEFT (``get_peft_model`` + ``save_pretrained``) with random non-zero lora_A
and lora_B (PEFT starts B at zero, which would make every adapter a no-op and test nothing).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the 2-rank workers run this file as a script
    sys.path.insert(0, str(ROOT))

from bloom_hpu.config import BloomConfig  # noqa: E402
from bloom_hpu.loading import load_model  # noqa: E402
from bloom_hpu.lora import LoraError, read_adapter  # noqa: E402
from bloom_hpu.tp import Parallel  # noqa: E402
from lora_adapters import make_adapter, peft_reference  # noqa: E402

CKPT = dict(hidden_size=64, n_layer=2, n_head=4, seed=7)
PROMPTS = ["Hello", "The quick brown fox jumps over the", "A b"]
MAX_LENGTH = 20

# (name, LoraConfig keywords, save as safetensors): target sets, ranks, patterns, rsLoRA, layers.
ADAPTERS = {
    "qkv-r4": (dict(r=4, lora_alpha=8, target_modules=["query_key_value"]), True),
    "all-r8-patterns": (dict(r=8, lora_alpha=16, target_modules=["query_key_value", "dense", "dense_h_to_4h",
                                                                    "dense_4h_to_h"],
                             rank_pattern={"dense_h_to_4h": 2}, alpha_pattern={"h.1.self_attention.dense": 3}), True),
    "mlp-rslora-layer1": (dict(r=2, lora_alpha=4, target_modules=["dense_4h_to_h", "dense"], use_rslora=True,
                               layers_to_transform=[1]), True),
    "regex-bin": (dict(r=3, lora_alpha=5, target_modules=r".*\.h\.0\..*(query_key_value|dense_h_to_4h)"), False),
}


def full_logits(generator, prompt: str) -> torch.Tensor:
    """Our logits at every position of one prompt: [T, V]."""
    ids = generator.tokenizer.encode(prompt)
    with torch.no_grad():
        cache = generator.model.allocate_cache(1, len(ids) + 1)
        return generator.model.full_logits(torch.tensor([ids]), torch.tensor([len(ids)]), cache)[0]


def hf_greedy(reference, ids: list[int], max_length: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_length=max_length, do_sample=False, num_beams=1, eos_token_id=None,
                                 pad_token_id=3)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def base(make_ckpt):
    return make_ckpt(**CKPT)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(base, root / name, seed=i, safetensors=st, **kw)
            for i, (name, (kw, st)) in enumerate(ADAPTERS.items())}


# --- the merged adapter against PEFT ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_merged_adapter_matches_peft(base, adapters, name):
    from generation.generator import Generator

    ours = Generator.from_pretrained(base, device="cpu", peft_weights=adapters[name])
    plain = Generator.from_pretrained(base, device="cpu")
    reference = peft_reference(base, adapters[name])
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        with torch.no_grad():
            want = reference(input_ids=torch.tensor([ids])).logits[0]
        got = full_logits(ours, prompt)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # The adapter really changes the model (the comparison would be empty otherwise).
        assert (got - full_logits(plain, prompt)).abs().max() > 1.0
    greedy = [r.token_ids for r in ours.generate(PROMPTS, max_length=MAX_LENGTH)]  # one batch
    want = [hf_greedy(reference, ours.tokenizer.encode(p), MAX_LENGTH) for p in PROMPTS]
    assert greedy == want
    assert greedy != [r.token_ids for r in plain.generate(PROMPTS, max_length=MAX_LENGTH)]


@pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True")
def test_fan_in_fan_out_is_ignored_for_linears_as_peft_does(base, adapters, tmp_path):
    # PEFT turns fan_in_fan_out off for nn.Linear (BLOOM's layers) when it loads such an adapter;
    # the same adapter with the flag set must give the same model.
    folder = shutil.copytree(adapters["qkv-r4"], tmp_path / "fifo")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(config | {"fan_in_fan_out": True}))
    from generation.generator import Generator

    ours = Generator.from_pretrained(base, device="cpu", peft_weights=folder)
    ids = ours.tokenizer.encode(PROMPTS[1])
    with torch.no_grad():
        want = peft_reference(base, folder)(input_ids=torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(ours, PROMPTS[1]), want, rtol=1e-4, atol=1e-4)


def test_bf16_merges_in_fp32_then_casts(base, adapters):
    adapter = read_adapter(adapters["all-r8-patterns"], BloomConfig.from_json(base / "config.json"))
    fp32, _ = load_model(base, adapter=adapter)
    bf16, _ = load_model(base, dtype=torch.bfloat16, adapter=adapter)
    for (name, w32), (_, w16) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert torch.equal(w32.to(torch.bfloat16), w16), name


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_merges_its_own_slice(base, adapters, world):
    adapter = read_adapter(adapters["all-r8-patterns"], BloomConfig.from_json(base / "config.json"))
    full = dict(load_model(base, adapter=adapter)[0].named_parameters())
    shards = [dict(load_model(base, parallel=Parallel(r, world), adapter=adapter)[0].named_parameters())
              for r in range(world)]
    for name in adapter.pairs:  # h.N.<module>.weight
        dim = 1 if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")) else 0
        torch.testing.assert_close(torch.cat([s[name] for s in shards], dim=dim), full[name], rtol=0, atol=1e-6)


# --- bad adapters: one clear line, before the model is read -------------------------------------------


def _edit(src: Path, dst: Path, config=None, tensors=None, drop=()) -> Path:
    """A copy of adapter ``src`` with config keys replaced, tensors changed, or files removed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        path = dst / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if tensors:
        weights = load_file(dst / "adapter_model.safetensors")
        save_file(tensors(weights), dst / "adapter_model.safetensors")
    for name in drop:
        (dst / name).unlink()
    return dst


def _without_b(weights):
    return {k: v for k, v in weights.items() if not (".h.1." in k and "lora_B" in k)}


def _wrong_rank(weights):
    return {k: (v[:2] if "lora_A" in k else v[:, :2]).contiguous() for k, v in weights.items()}


def _extra(weights):
    return weights | {"base_model.model.lm_head.modules_to_save.default.weight": torch.zeros(4, 4)}


def _deeper(weights):
    return {k.replace(".h.1.", ".h.7."): v for k, v in weights.items()}


BAD = [
    (dict(config={"peft_type": "PREFIX_TUNING"}), "peft_type is 'PREFIX_TUNING'; only LORA"),
    (dict(config={"bias": "all"}), "bias is 'all'"),
    (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (dict(config={"use_dora": True}), "DoRA"),
    (dict(config={"target_modules": ["query_key_value", "lm_head"]}), "target_modules 'lm_head' not supported"),
    (dict(config={"target_modules": ["dense"]}), "does not target it"),
    (dict(config={"r": 0}), "r must be a positive integer"),
    (dict(tensors=_without_b), "has lora_A but no lora_B"),
    (dict(tensors=_wrong_rank), "do not fit the base model"),
    (dict(tensors=_extra), "is not a LoRA weight of a BLOOM linear"),
    (dict(tensors=_deeper), "the base model has 2 layers"),
    (dict(drop=["adapter_model.safetensors"]), "has no adapter_model.safetensors or adapter_model.bin"),
    (dict(drop=["adapter_config.json"]), "has no adapter_config.json"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(BAD)])
def test_bad_adapters_are_refused_with_one_line(base, adapters, tmp_path, capsys, edit, message):
    import bloom

    folder = _edit(adapters["qkv-r4"], tmp_path / "bad", **edit)
    with pytest.raises(LoraError, match=message.replace("(", r"\(")):
        read_adapter(folder, BloomConfig.from_json(base / "config.json"))
    code = bloom.main(["--weights", str(base), "--peft_weights", str(folder), "Hello"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [err.strip().splitlines()[-1]]
    assert message in err


def test_broken_files_and_other_models(base, adapters, tmp_path, make_ckpt):
    broken = _edit(adapters["qkv-r4"], tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    config = BloomConfig.from_json(base / "config.json")
    with pytest.raises(LoraError, match="cannot read .*adapter_model.safetensors"):
        read_adapter(broken, config)
    (broken / "adapter_config.json").write_text("{")
    with pytest.raises(LoraError, match="not valid JSON"):
        read_adapter(broken, config)
    with pytest.raises(LoraError, match="does not exist"):
        read_adapter(tmp_path / "nowhere", config)
    wider = BloomConfig.from_json(make_ckpt(hidden_size=32, n_layer=2, n_head=4, seed=7) / "config.json")
    with pytest.raises(LoraError, match=r"needs \(4, 32\) and \(96, 4\) \(hidden size 32"):
        read_adapter(adapters["qkv-r4"], wider)


def test_cli_merges_the_adapter(base, adapters, capsys):
    import bloom

    folder = adapters["qkv-r4"]
    assert bloom.main(["--weights", str(base), "--peft_weights", str(folder), "--max_length", str(MAX_LENGTH),
                       "--quiet", PROMPTS[1]]) == 0
    captured = capsys.readouterr()
    assert "LoRA adapter" in captured.err and "merged" in captured.err
    reference = peft_reference(base, folder)
    from generation.run.batch import BloomTokenizer  # noqa: F401 (the CLI's tokenizer: same file)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    ids = tokenizer.encode(PROMPTS[1]).ids
    assert captured.out.rstrip("\n") == tokenizer.decode(hf_greedy(reference, ids, MAX_LENGTH))


# --- merged under 2-rank tensor parallelism equals one process ------------------------------------------


@pytest.mark.slow
def test_two_rank_merge_matches_one_process(base, adapters, tmp_path):
    from generation.generator import Generator

    folder = adapters["all-r8-patterns"]
    with socket.socket() as s:  # a free port: other test runs may share the machine
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(port),
               __file__, "--lora-tp-worker", str(base), str(folder), str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    alone = Generator.from_pretrained(base, device="cpu", peft_weights=folder)
    want_logits = torch.cat([full_logits(alone, p) for p in PROMPTS])
    want_greedy = [r.token_ids for r in alone.generate(PROMPTS, max_length=MAX_LENGTH)]
    for record in ranks:
        torch.testing.assert_close(record["logits"], want_logits, rtol=1e-4, atol=1e-4)
        assert record["greedy"] == want_greedy


def _tp_worker(base: str, adapter: str, out: str) -> int:
    from bloom_hpu.runtime.launch import init_parallel, shutdown
    from generation.generator import Generator

    parallel = init_parallel("cpu")
    generator = Generator.from_pretrained(base, device="cpu", parallel=parallel, peft_weights=adapter)
    record = {"logits": torch.cat([full_logits(generator, p) for p in PROMPTS]),
              "greedy": [r.token_ids for r in generator.generate(PROMPTS, max_length=MAX_LENGTH)]}
    torch.save(record, Path(out) / f"rank{parallel.rank}.pt")
    shutdown()
    return 0


if __name__ == "__main__" and "--lora-tp-worker" in sys.argv:
    torch.set_num_threads(1)
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]  # the launcher adds it
    from bloom_hpu.runtime.launch import exit_process

    # not sys.exit: a rank's interpreter exit can abort in the distributed stack's destructors
    exit_process(_tp_worker(*args[args.index("--lora-tp-worker") + 1 :]))
