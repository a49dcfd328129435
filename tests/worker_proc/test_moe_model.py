"""Mixture-of-experts decoders (Qwen3-MoE with a dense layer among sparse ones, Mixtral) against
transformers on tiny checkpoints with experts of an odd size: logits through the paged cache in
chunks; the fused 3-D expert tensors of transformers 5 load as the per-expert ones do; a missing or
misshapen expert tensor is refused; dummy weights have the checkpoint's shapes; adapters cannot
target the experts yet, and say so."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from ledgerserve.shared.adapter_format import AdapterError, BaseShapes, read_manifest
from ledgerserve.worker_proc.models.config import load_model_config
from ledgerserve.worker_proc.models.loader import build_model
from ledgerserve.worker_proc.models.moe import SparseMoeBlock
from tests.adapter_factory import make_peft_adapter
from tests.model_factory import load_reference
from tests.worker_proc.test_model import _caches, _chunk_inputs

CPU = torch.device("cpu")


def test_logits_match_transformers_in_chunks(tiny_moe_checkpoint: str) -> None:
    cfg = load_model_config(tiny_moe_checkpoint)
    assert cfg.moe is not None and 2 * cfg.moe.intermediate_size != cfg.hidden_size
    model = build_model(cfg, tiny_moe_checkpoint, "auto", torch.float32, CPU, seed=0)
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == list(cfg.moe.sparse_layers) and sparse  # Qwen3-MoE's mlp_only_layers stay dense
    ref = load_reference(tiny_moe_checkpoint)
    ids = torch.randint(0, cfg.vocab_size, (45,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = ref(ids[None]).logits[0]  # [45, vocab]
    caches, table, got = _caches(cfg, 16), [9, 2, 14, 0, 7, 3, 11, 5, 1, 12, 4, 6], []
    for start, end in [(0, 7), (7, 30), (30, 31), (31, 45)]:
        got.append(model.compute_logits(model(_chunk_inputs(ids.tolist(), table, start, end), caches)))
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=1e-4)


def _fused(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with every layer's experts as transformers 5 holds them in memory."""
    out, experts = {}, {}
    for name, tensor in tensors.items():
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".experts.")
        if len(parts) != 2:
            out[name] = tensor
            continue
        expert, kind = parts[1].split(".")[:2]
        kind = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(kind, kind)
        experts.setdefault(parts[0], {}).setdefault(kind, {})[int(expert)] = tensor
    for prefix, kinds in experts.items():
        num = len(kinds["down_proj"])
        gate_up = [torch.cat([kinds["gate_proj"][e], kinds["up_proj"][e]]) for e in range(num)]
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack(gate_up)  # [E, 2I, H]
        out[f"{prefix}.experts.down_proj"] = torch.stack([kinds["down_proj"][e] for e in range(num)])  # [E, H, I]
    return out


def _rewritten(src: str, dst, tensors: dict[str, torch.Tensor]) -> str:
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return str(dst)


def test_fused_expert_tensors_load_as_per_expert_ones(tiny_moe_checkpoint: str, tmp_path) -> None:
    tensors = load_file(os.path.join(tiny_moe_checkpoint, "model.safetensors"))
    fused_dir = _rewritten(tiny_moe_checkpoint, tmp_path / "fused", _fused(tensors))
    cfg = load_model_config(tiny_moe_checkpoint)
    per_expert = build_model(cfg, tiny_moe_checkpoint, "auto", torch.float32, CPU, seed=0)
    fused = build_model(cfg, fused_dir, "auto", torch.float32, CPU, seed=0)
    for (name, a), (_, b) in zip(per_expert.named_parameters(), fused.named_parameters()):
        assert torch.equal(a, b), name


def test_missing_or_misshapen_expert_tensors_are_refused(tiny_moe_checkpoint: str, tmp_path) -> None:
    tensors = load_file(os.path.join(tiny_moe_checkpoint, "model.safetensors"))
    cfg = load_model_config(tiny_moe_checkpoint)
    expert = next(name for name in tensors if ".experts.1." in name)
    missing = {k: v for k, v in tensors.items() if k != expert}
    with pytest.raises(ValueError, match="lacks weights"):
        build_model(cfg, _rewritten(tiny_moe_checkpoint, tmp_path / "missing", missing), "auto", torch.float32, CPU, 0)
    cut = {**tensors, expert: tensors[expert][:-1]}
    with pytest.raises(ValueError, match="does not fit"):
        build_model(cfg, _rewritten(tiny_moe_checkpoint, tmp_path / "cut", cut), "auto", torch.float32, CPU, 0)


def test_dummy_weights_have_the_checkpoints_shapes(tiny_moe_checkpoint: str) -> None:
    cfg = load_model_config(tiny_moe_checkpoint)
    dummy = build_model(cfg, tiny_moe_checkpoint, "dummy", torch.float32, CPU, seed=5)
    real = build_model(cfg, tiny_moe_checkpoint, "auto", torch.float32, CPU, seed=5)
    for (name, a), (_, b) in zip(dummy.named_parameters(), real.named_parameters()):
        assert a.shape == b.shape and a.abs().sum() > 0, name
    assert torch.isfinite(dummy.compute_logits(dummy(_chunk_inputs([1, 2, 3], [1], 0, 3), _caches(cfg, 2)))).all()


def test_adapters_for_the_experts_are_refused(tiny_moe_checkpoint: str, tmp_path) -> None:
    """Expert adapters (PEFT's target_parameters on the experts' 3-D tensors, or MLP module names
    that only experts have) are refused, with the reason; attention adapters read."""
    with open(os.path.join(tiny_moe_checkpoint, "config.json"), encoding="utf-8") as f:
        base = BaseShapes.from_hf_config(json.load(f))
    attention = make_peft_adapter(tiny_moe_checkpoint, tmp_path / "attn", r=4, alpha=8, targets=["q_proj", "o_proj"])
    assert {m.kind for m in read_manifest(attention, base, 16, (str(tmp_path),)).modules} == {"q_proj", "o_proj"}
    config_path = os.path.join(attention, "adapter_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({**config, "target_parameters": ["mlp.experts.down_proj"]}, f)
    with pytest.raises(AdapterError, match="lack tensor .*mlp.experts.lora_A"):  # its tensors are not there
        read_manifest(attention, base, 16, (str(tmp_path),))
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump({**config, "target_modules": ["q_proj", "down_proj"]}, f)
    if all(layer in base.sparse_layers for layer in range(base.num_layers)):  # Mixtral: no layer has down_proj
        with pytest.raises(AdapterError, match="down_proj"):
            read_manifest(attention, base, 16, (str(tmp_path),))
