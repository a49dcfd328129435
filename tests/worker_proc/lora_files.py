"""Random PEFT-format adapter directories written directly (no PEFT model needed), in any file
dtype, rank, targets (lm_head included) and rank/alpha patterns; and the pre-slot-image
loading path (safetensors' own reader, one copy per tensor), as the reference the slot image
path is checked against."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, BaseShapes, read_manifest
from worker_proc.lora.manager import LoraManager
from worker_proc.lora.slot_image import module_path


def write_adapter(path: str, base: BaseShapes, *, r: int, targets: list[str], seed: int,
                  dtype: torch.dtype = torch.float32, alpha: float = 16.0, rank_pattern: dict | None = None,
                  alpha_pattern: dict | None = None, use_rslora: bool = False) -> str:
    """An adapter of `base` at `path`; a module's rank follows `rank_pattern` (PEFT key suffixes)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, kind, _ in base.module_names():
        if kind not in targets:
            continue
        rank = next((v for k, v in (rank_pattern or {}).items() if name == k or name.endswith("." + k)), r)
        in_f, out_f = base.in_out(kind)
        prefix = f"base_model.model.{name}"
        tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, in_f, generator=gen) * in_f**-0.5).to(dtype)
        tensors[f"{prefix}.lora_B.weight"] = (torch.randn(out_f, rank, generator=gen) * 0.05).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
              "lora_dropout": 0.0, "use_rslora": use_rslora, "rank_pattern": rank_pattern or {},
              "alpha_pattern": alpha_pattern or {}, "task_type": "CAUSAL_LM"}
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def reference_load(lora: LoraManager, slot: int, path: str, base: BaseShapes, max_lora_rank: int,
                   dtype: torch.dtype) -> None:
    """Load `path` into `slot` as the worker did before slot images: each tensor read by
    safetensors, converted to `dtype`, and copied slice by slice (LoraWeights.load_slot)."""
    manifest = read_manifest(path, base, max_lora_rank)
    per_module: dict[str, list] = {}
    with safe_open(manifest.weights_path, framework="pt", device="cpu") as f:
        for m in manifest.modules:
            name, s = module_path(m.layer, m.kind)
            a, b = f.get_tensor(m.a_key).to(dtype), f.get_tensor(m.b_key).to(dtype)
            slices = per_module.setdefault(name, [None] * len(lora.weights[name].output_sizes))
            slices[s] = (a, b, m.scaling)
    for name, weights in lora.weights.items():
        weights.load_slot(slot, per_module.get(name, [None] * len(weights.output_sizes)))
