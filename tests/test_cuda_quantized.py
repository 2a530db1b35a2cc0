"""Quantized decode on an NVIDIA card through our Triton kernels (bloom_hpu/runtime/cuda_quantized.py):
the kernels are what the card runs, and the tokens are transformers' on the dequantized weights.

Runs only where there is a CUDA card and Triton (the CPU suite skips it); the device check runs it
with ``python -m pytest tests/test_cuda_quantized.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import transformers

from dequantized import write_dequantized
from generation.generator import Generator
from utils.random_checkpoint import make_random_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                                reason="needs a CUDA device and Triton")

PROMPTS = ["The quick brown fox jumps over the lazy dog", "Hello, world", "Numbers 1 2 3 4"]
NEW = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # 128 wide: int4 groups of 64 and a K that is not a multiple of the kernels' 256-weight tile.
    return make_random_checkpoint(tmp_path_factory.mktemp("cuda-q"), hidden_size=128, n_layer=3, n_head=4, seed=11)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_quantized_decode_runs_our_kernels_with_transformers_tokens(folder, tmp_path, mode, dtype):
    ours = Generator.from_pretrained(folder, device="cuda", dtype=dtype, quantize=mode,
                                     group_size=64 if mode == "int4" else None)
    assert ours.backend.quantized_kernels
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    reference = transformers.BloomForCausalLM.from_pretrained(
        write_dequantized(folder, ours.model, tmp_path / "dq"),
        torch_dtype=torch_dtype).to("cuda").eval()
    for prompt in PROMPTS:
        ids = ours.tokenizer.encode(prompt)
        got = ours.generate(prompt, max_length=len(ids) + NEW, ignore_eos=True)[0].token_ids
        theirs = reference.generate(torch.tensor([ids], device="cuda"), max_new_tokens=NEW, do_sample=False,
                                    pad_token_id=3)[0, len(ids):].tolist()
        assert got == theirs
    # Every decode step replayed a captured graph, and the batch too runs on the kernels' rows.
    batch = ours.generate(PROMPTS, max_length=24, ignore_eos=True)
    assert [r.token_ids for r in batch] == [ours.generate(p, max_length=24, ignore_eos=True)[0].token_ids
                                            for p in PROMPTS]
    assert ours.backend.graph_count() == len(ours.backend.signatures_of("decode"))
