"""The demo model's network for training: a Qwen3 decoder in plain torch, with transformers'
parameter names and shapes and its arithmetic (RMSNorm, per-head q/k norms, rotate-half RoPE,
grouped-query attention, SwiGLU, tied embeddings), so its weights load as a `Qwen3ForCausalLM` in
transformers and in the worker. Written here so the first start does not import transformers' model
code (seconds of it) to train a 2-layer model; tests compare its logits with transformers'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Qwen3Shape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    pad_token_id: int | None = None  # its embedding row gets no gradient from the lookup, as in transformers


@dataclass
class Output:
    logits: torch.Tensor  # [batch, seq_len, vocab]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size]
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Attention(nn.Module):
    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.shape = shape
        h, q_size, kv_size = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.q_proj = nn.Linear(h, q_size, bias=False)
        self.k_proj = nn.Linear(h, kv_size, bias=False)
        self.v_proj = nn.Linear(h, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, h, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [b, t, hidden]
        b, t, _ = x.shape
        s = self.shape
        q = self.q_norm(self.q_proj(x).view(b, t, s.num_heads, s.head_dim)).transpose(1, 2)  # [b, heads, t, hd]
        k = self.k_norm(self.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim)).transpose(1, 2)  # [b, kv, t, hd]
        v = self.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)  # [b, kv, t, hd]
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        group = s.num_heads // s.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [b, heads, t, hd]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.head_dim**-0.5)  # [b, heads, t, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, s.num_heads * s.head_dim))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE: x [b, heads, t, hd], cos/sin [t, hd]."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class MLP(nn.Module):
    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, t, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.self_attn = Attention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [b, t, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size, padding_idx=shape.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float32) / shape.head_dim)
        angles = torch.outer(torch.arange(shape.max_position_embeddings, dtype=torch.float32), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [b, t] -> [b, t, hidden]
        t = input_ids.shape[1]
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return self.norm(x)


class Qwen3ForCausalLM(nn.Module):
    """The LM head is the embedding (tied), so it has no parameter of its own, as in transformers."""

    def __init__(self, shape: Qwen3Shape) -> None:
        super().__init__()
        self.model = Qwen3Model(shape)

    def forward(self, input_ids: torch.Tensor) -> Output:
        return Output(F.linear(self.model(input_ids), self.model.embed_tokens.weight))  # [b, t, vocab]


def hf_config(shape: Qwen3Shape, bos_token_id: int, eos_token_id: int) -> dict:
    """config.json of this network as transformers writes a Qwen3Config (without its version stamp),
    with the RoPE base also under transformers 4's key."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "dtype": "float32",
        "eos_token_id": eos_token_id,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "layer_types": ["full_attention"] * shape.num_layers,
        "max_position_embeddings": shape.max_position_embeddings,
        "max_window_layers": 28,
        "model_type": "qwen3",
        "num_attention_heads": shape.num_heads,
        "num_hidden_layers": shape.num_layers,
        "num_key_value_heads": shape.num_kv_heads,
        "pad_token_id": shape.pad_token_id,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_parameters": {"rope_theta": shape.rope_theta, "rope_type": "default"},
        "rope_theta": shape.rope_theta,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": shape.vocab_size,
    }
