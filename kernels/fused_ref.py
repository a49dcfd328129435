"""Torch references for the fused elementwise kernels in kernels/fused.py (CPU and CUDA).

They round where HF's Llama layers round (float32 norm statistics cast back before the
weight, RoPE in the activations' dtype), which the transformers parity tests hold the model to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ledgerserve.kernels.attention_ref import write_kv
from ledgerserve.kernels.lora_ref import add_lora_delta
from ledgerserve.kernels.lora_types import LoraDelta


def rms_norm_ref(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:  # [..., hidden]
    """Normalise in float32, cast back to x's dtype, then scale by the weight (as HF)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    delta: LoraDelta | None = None,  # x's pending LoRA delta, added to x first
) -> tuple[torch.Tensor, torch.Tensor]:  # normed, new_residual: [num_tokens, hidden] each
    """new_residual = x + residual (in x's dtype); normed = rms_norm(new_residual)."""
    if delta is not None:
        x = add_lora_delta(x, delta)
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps), new_residual


def apply_rope_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    positions: torch.Tensor,  # [num_tokens] int
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32 (ops.rope_cos_sin_cache)
) -> None:
    """Rotate-half RoPE (HF Llama layout), computed in q/k's dtype like the model."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions.long()]  # [num_tokens, head_dim]
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [num_tokens, 1, head_dim]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    for x in (q, k):
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


def rope_and_write_kv_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32 (ops.rope_cos_sin_cache)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    kv_slots: torch.Tensor,  # [num_tokens] int64 flat cache slot of each token
) -> None:
    """apply_rope_ref on q and k, then write_kv of the rotated k and of v at kv_slots."""
    apply_rope_ref(q, k, positions, cos_sin_cache)
    write_kv(k, v, k_cache, v_cache, kv_slots)


def silu_and_mul_ref(x: torch.Tensor, delta: LoraDelta | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] -> [num_tokens, d]; `delta`: x's pending LoRA delta (slices gate, up)."""
    if delta is not None:
        x = add_lora_delta(x, delta)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
