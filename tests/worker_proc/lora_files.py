"""Random PEFT-format adapter directories written directly (no PEFT model needed), in any file
dtype, rank, targets (lm_head included) and rank/alpha patterns, with PEFT's saved copies of
the embedding and lm_head or not, or with the tensors in any order and unaligned; and the
pre-CPU-tier loading path (safetensors' own reader, one copy per tensor), as the reference the
file image path is checked against."""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ledgerserve.shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, BaseShapes, read_manifest
from ledgerserve.worker_proc.lora.file_image import module_path
from ledgerserve.worker_proc.lora.manager import LoraManager
from ledgerserve.worker_proc.lora.weights import LoraWeights

SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_adapter(
    path: str,
    base: BaseShapes,
    *,
    r: int,
    targets: list[str],
    seed: int,
    dtype: torch.dtype = torch.float32,
    alpha: float = 16.0,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
    use_rslora: bool = False,
    saved_embeddings: bool = False,
) -> str:
    """An adapter of `base` at `path`; a module's rank follows `rank_pattern` (PEFT key suffixes).
    `saved_embeddings`: the file also holds copies of the embedding and lm_head, as PEFT saves
    them for an adapter on lm_head (the worker reads them for the digest only)."""
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
    if saved_embeddings:
        for key in ("base_model.model.lm_head.base_layer.weight", "base_model.model.model.embed_tokens.weight"):
            tensors[key] = torch.randn(base.vocab_size, base.hidden_size, generator=gen).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE))
    config = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": alpha,
        "target_modules": targets,
        "bias": "none",
        "lora_dropout": 0.0,
        "use_rslora": use_rslora,
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "task_type": "CAUSAL_LM",
    }
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return path


def write_raw(path: str, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A safetensors file of `tensors` in this order, packed: the safetensors library orders
    tensors by dtype, which keeps each aligned to its item size; this need not."""
    entries, offset = {}, 0
    for key, t in tensors:
        num_bytes = t.numel() * t.element_size()
        entries[key] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for _, t in tensors:
            f.write(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def reference_load(
    lora: LoraManager | dict[str, LoraWeights],
    slot: int,
    path: str,
    base: BaseShapes,
    max_lora_rank: int,
    dtype: torch.dtype,
) -> None:
    """Load `path` into `slot` as the worker did before the CPU tier: each tensor read by
    safetensors, converted to `dtype`, and copied slice by slice (LoraWeights.load_slot) into
    the buffers of `lora` (a LoraManager's, or any)."""
    weights = lora if isinstance(lora, dict) else lora.weights
    manifest = read_manifest(path, base, max_lora_rank)
    per_module: dict[str, list] = {}
    with safe_open(manifest.weights_path, framework="pt", device="cpu") as f:
        for m in manifest.modules:
            name, s = module_path(m.layer, m.kind)
            a, b = f.get_tensor(m.a_key).to(dtype), f.get_tensor(m.b_key).to(dtype)
            slices = per_module.setdefault(name, [None] * len(weights[name].output_sizes))
            slices[s] = (a, b, m.scaling)
    for name, w in weights.items():
        w.load_slot(slot, per_module.get(name, [None] * len(w.output_sizes)))
