"""Tiny random HF checkpoints made with transformers itself, for model and runner tests."""

from __future__ import annotations

import os
from typing import Any

import torch

DENSE_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
MOE_ARCHS = ("qwen3_moe", "mixtral")
ARCHS = DENSE_ARCHS + MOE_ARCHS

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(arch: str) -> Any:
    """A transformers config of `arch` exercising what sets that family apart."""
    import transformers

    if arch == "llama":  # llama3 rope scaling, GQA
        rope = dict(
            rope_type="llama3",
            rope_theta=50000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=32,
        )
        return transformers.LlamaConfig(**_COMMON, rope_scaling=rope, tie_word_embeddings=False)
    if arch == "qwen2":  # qkv bias
        return transformers.Qwen2Config(**_COMMON, rope_theta=1000000.0, tie_word_embeddings=False)
    if arch == "qwen3":  # per-head q/k norm, tied embeddings, head_dim != hidden / heads
        return transformers.Qwen3Config(**_COMMON, head_dim=24, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen3_moe":  # q/k norm, experts of an odd size (2 x 36 != hidden), a dense layer, top-k renormalised
        moe = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=36, norm_topk_prob=True)
        return transformers.Qwen3MoeConfig(**_COMMON, **moe, decoder_sparse_step=1, mlp_only_layers=[1])
    if arch == "mixtral":  # experts in every layer, 5 of them, top-2
        mixtral = {**_COMMON, "intermediate_size": 40}
        return transformers.MixtralConfig(**mixtral, num_local_experts=5, num_experts_per_tok=2, sliding_window=None)
    raise ValueError(f"unknown arch {arch!r}; known: {ARCHS}")


def make_tiny_checkpoint(arch: str, path: str | os.PathLike[str], seed: int = 0, **overrides: Any) -> str:
    """Write a tiny random `arch` checkpoint (config.json + model.safetensors) to `path`;
    `overrides` replace fields of its config (e.g. vocab_size)."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_weights(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def load_reference(path: str | os.PathLike[str]) -> Any:
    """The transformers model for a checkpoint, fp32, eager attention."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _spread_weights(model: Any, seed: int) -> None:
    """Give norms and biases non-trivial values so their loading is actually checked."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            elif param.dim() >= 2:  # matrices, and the experts' fused 3-D weights
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
