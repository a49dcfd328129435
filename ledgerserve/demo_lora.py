"""The LoRA that trains the demo adapters, saved in PEFT's file format: what the demo build needs
of PEFT, so that serving the demo needs no PEFT.

`add_lora` wraps every targeted `nn.Linear` of a transformers model in a `LoraLinear` (the base
frozen) with PEFT's initialisation: A kaiming-uniform (a = sqrt(5)), B zeros, the update scaled
by alpha / r. `save_adapter` writes `adapter_config.json` with the keys PEFT writes and
`adapter_model.safetensors` with PEFT's tensor names
(`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`), which PEFT loads with
`PeftModel.from_pretrained`, and so does the server.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."  # how PEFT names the wrapped model's modules in its saved files


class LoraLinear(nn.Module):
    """`base_layer(x) + lora_B(lora_A(x)) * alpha / rank`, as PEFT's LoRA Linear without dropout."""

    def __init__(self, base_layer: nn.Linear, rank: int, alpha: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.scaling = alpha / rank
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False)  # weight [rank, in]
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False)  # weight [out, rank]
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return self.base_layer(x) + self.lora_B(self.lora_A(x)) * self.scaling


def add_lora(model: nn.Module, rank: int, alpha: int, targets: tuple[str, ...], seed: int) -> nn.Module:
    """`model` with every `nn.Linear` named one of `targets` (the last part of its name) wrapped in
    a fresh LoraLinear, in module order, A drawn from one generator seeded with `seed`; every other
    weight frozen. Returns `model`, changed in place."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    wrapped = [(name, module) for name, module in model.named_modules() if _is_target(name, module, targets)]
    if not wrapped:
        raise ValueError(f"no nn.Linear module named one of {targets}")
    for name, module in wrapped:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, LoraLinear(module, rank, alpha, generator))
    return model


def _is_target(name: str, module: nn.Module, targets: tuple[str, ...]) -> bool:
    return isinstance(module, nn.Linear) and name.rpartition(".")[2] in targets


def lora_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA weights of `model` under PEFT's names, in module order."""
    weights = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLinear):
            weights[f"{PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A.weight.detach().contiguous()
            weights[f"{PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B.weight.detach().contiguous()
    return weights


def peft_config(rank: int, alpha: int, targets: tuple[str, ...]) -> dict:
    """adapter_config.json as PEFT writes it for a plain LoRA (no model card, no version stamp)."""
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(targets),
        "task_type": None,
        "use_dora": False,
        "use_rslora": False,
    }


def save_adapter(model: nn.Module, path: Path, rank: int, alpha: int, targets: tuple[str, ...]) -> None:
    """adapter_config.json and adapter_model.safetensors of the LoRA weights of `model` in `path`."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps(peft_config(rank, alpha, targets), indent=2, sort_keys=True) + "\n"
    (path / "adapter_config.json").write_text(text, encoding="utf-8")
    save_file(lora_weights(model), str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
