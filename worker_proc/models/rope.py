"""Rotary position embedding (rotate-half layout, as in HF Llama), with Llama-3 scaling."""

from __future__ import annotations

import math

import torch

from ledgerserve.kernels import ops
from ledgerserve.worker_proc.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # [head_dim // 2] float32
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_position: int) -> None:
        super().__init__()
        # a plain attribute, not a buffer: Module.to(dtype) must not round it to bf16/fp16
        self.inv_freq = rope_inv_freq(rope, head_dim)  # [head_dim // 2] float32
        self.max_position = max_position
        self.cache: torch.Tensor | None = None  # [max_position, head_dim] float32, built on first use

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        """[max_position, head_dim] float32: cos of every position's angles, then sin (kernels/ops.py)."""
        if self.cache is None or self.cache.device != device:
            self.cache = ops.rope_cos_sin_cache(self.inv_freq.to(device), self.max_position)
        return self.cache
