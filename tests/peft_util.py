"""Tiny real PEFT LoRA adapters for tests: made by peft itself, saved as safetensors."""

from __future__ import annotations

import os
from typing import Any

import torch


def build_peft_model(base_dir: str, seed: int = 0, **lora_kwargs: Any) -> Any:
    """get_peft_model over the base checkpoint, with random (non-zero) LoRA weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    kwargs = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], **lora_kwargs}
    return get_peft_model(base, LoraConfig(init_lora_weights=False, **kwargs))


def make_tiny_peft_adapter(base_dir: str, out_dir: str | os.PathLike[str], seed: int = 0, **lora_kwargs: Any) -> str:
    """Write a PEFT adapter (adapter_config.json + adapter_model.safetensors) to `out_dir`."""
    model = build_peft_model(base_dir, seed, **lora_kwargs)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def peft_ranks_scalings(model: Any) -> dict[str, tuple[int, float]]:
    """Full module path -> (rank, scaling) of the default adapter, as PEFT computes them."""
    out = {}
    for name, module in model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "r", {}):
            out[name] = (module.r["default"], float(module.scaling["default"]))
    return out
