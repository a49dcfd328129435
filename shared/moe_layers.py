"""Which decoder layers of a HF config have a sparse (mixture-of-experts) MLP, as transformers
builds them: Mixtral's every layer; Qwen3-MoE's every `decoder_sparse_step`-th layer that is not
in `mlp_only_layers`; none for a dense architecture. Read by the model (worker_proc/models/config.py)
and by the adapter checks (shared/adapter_types.BaseShapes), so both see the same layers."""

from __future__ import annotations

from typing import Any

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# a transformers-4 checkpoint's expert modules, `model.layers.L.<block>.experts.E.<gate|up|down>`
PER_EXPERT_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}


def moe_architecture(cfg: dict[str, Any]) -> str | None:
    return next((a for a in cfg.get("architectures") or [] if a in MOE_ARCHITECTURES), None)


def sparse_mlp_layers(cfg: dict[str, Any]) -> tuple[int, ...]:
    arch = moe_architecture(cfg)
    num_layers = int(cfg["num_hidden_layers"])
    if arch is None:
        return ()
    if arch == "MixtralForCausalLM":
        return tuple(range(num_layers))
    step = int(cfg.get("decoder_sparse_step", 1))
    dense = set(cfg.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers) if i not in dense and step > 0 and (i + 1) % step == 0)


def expert_shapes(cfg: dict[str, Any]) -> tuple[int, int]:
    """(number of experts, one expert's intermediate size); (0, 0) for a dense architecture."""
    arch = moe_architecture(cfg)
    if arch is None:
        return 0, 0
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    if arch == "MixtralForCausalLM":
        return num_experts, int(cfg["intermediate_size"])
    return num_experts, int(cfg["moe_intermediate_size"])


def per_expert_names(cfg: dict[str, Any]) -> tuple[str, str, str, str]:
    """(sparse block, gate, up, down) as transformers 4 named one expert's modules; Qwen3-MoE's
    names for a dense architecture (which has no experts to name)."""
    return PER_EXPERT_NAMES.get(moe_architecture(cfg) or "", PER_EXPERT_NAMES["Qwen3MoeForCausalLM"])
