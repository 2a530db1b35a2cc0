"""A quantized model's weights written back as a float checkpoint: what transformers (and PEFT) run as
the reference for our quantized arithmetic."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from bloom_hpu.int4 import dequantized_int4
from bloom_hpu.quantize import dequantized


def dequantized_weight(module) -> torch.Tensor:
    """``q * scale`` in fp32 of a quantized module (int8 rows, or int4 groups)."""
    if module.qweight.dtype == torch.uint8:
        return dequantized_int4(module.qweight, module.scales)
    return dequantized(module.qweight, module.scales)


def dequantized_state(model) -> dict[str, torch.Tensor]:
    """Our quantized model's weights as the checkpoint names them, each ``q * scale`` in fp32."""
    return {f"{name}.weight": dequantized_weight(module).cpu() for name, module in model.named_modules()
            if getattr(module, "qweight", None) is not None}


def write_dequantized(folder: Path, model, out: Path) -> Path:
    """``folder``'s checkpoint with every quantized weight replaced by ``model``'s dequantized one."""
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (out / item.name).write_bytes(item.read_bytes())
    weights = load_file(folder / "model.safetensors")
    replaced = dequantized_state(model)
    assert set(replaced) <= set(weights) and "word_embeddings.weight" in replaced
    weights.update(replaced)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def held_out_perplexities(checkpoint: Path, quantized_model, prepare: Callable | None = None) -> tuple[float, float]:
    """(fp32's, the reference's) perplexity of ``checkpoint`` (the embedded KJV model) on its held-out
    chapters (when the corpus can be fetched), else on its own README's text: the reference is
    transformers on ``quantized_model``'s dequantized weights, after ``prepare(reference)``."""
    import transformers

    from utils import kjv_corpus

    try:
        texts = kjv_corpus.load().held_out[:3]
    except Exception:
        texts = [(checkpoint / "README.md").read_text()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    fp32 = transformers.BloomForCausalLM.from_pretrained(checkpoint).eval()
    reference = transformers.BloomForCausalLM.from_pretrained(checkpoint).eval()
    state = {f"transformer.{k}": v for k, v in dequantized_state(quantized_model).items()}
    assert not reference.load_state_dict(state, strict=False).unexpected_keys
    if prepare is not None:
        prepare(reference)

    def perplexity(model):
        total, count = 0.0, 0
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :512]
            with torch.no_grad():
                total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
        return math.exp(total / count)

    return perplexity(fp32), perplexity(reference)
