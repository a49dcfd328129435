"""PEFT LoRA adapters of a tiny base checkpoint, made with peft itself, for worker tests."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.model_factory import load_reference


def make_peft_adapter(
    base_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    r: int,
    alpha: float,
    targets: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
) -> str:
    """Write a random LoRA adapter for the checkpoint at `base_dir` to `out_dir` (PEFT's
    adapter_config.json + adapter_model.safetensors). `init_lora_weights=False` gives B
    random non-zero values, so the adapter changes the model's output."""
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        init_lora_weights=False,
    )
    torch.manual_seed(seed)
    model = get_peft_model(load_reference(base_dir), lora_config)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    return str(out_dir)


def load_peft_reference(base_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str]) -> Any:
    """The base transformers model with the adapter applied by PEFT, fp32, eval mode."""
    from peft import PeftModel

    return PeftModel.from_pretrained(load_reference(base_dir), str(adapter_dir)).eval()
