"""LoRA adapters made by PEFT itself for the tests, and PEFT's model as their reference."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def make_adapter(base: Path, out: Path, seed: int = 0, safetensors: bool = True, **lora) -> Path:
    """A PEFT LoRA adapter for the checkpoint ``base``, with random non-zero A and B, saved in ``out``."""
    from peft import LoraConfig, get_peft_model

    transformers.logging.set_verbosity_error()
    model = get_peft_model(transformers.BloomForCausalLM.from_pretrained(base), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name:  # [r, in]
                param.copy_(torch.randn(param.shape, generator=gen) / param.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]: about half a base weight's size after scaling
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5 / param.shape[1] ** 0.5)
    model.save_pretrained(out, safe_serialization=safetensors)
    return out


def peft_reference(base: Path, adapter: Path):
    from peft import PeftModel

    transformers.logging.set_verbosity_error()
    return PeftModel.from_pretrained(transformers.BloomForCausalLM.from_pretrained(base), adapter).eval()
