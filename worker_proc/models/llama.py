"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral) over a paged KV cache.

One forward takes a flat batch of tokens from many requests; attention finds each
request's keys through `PagedAttentionMetadata`. Each token carries its adapter slot
(`lora_slots`, -1 = base model); every projection, lm_head included, receives the
batch's `LoraMapping` and adds its slot's LoRA delta.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.attention_ref import PagedAttentionMetadata, paged_attention_ref
from worker_proc.lora.mapping import LoraMapping
from worker_proc.models.config import ModelConfig
from worker_proc.models.layers import GatedMLP, RMSNorm, SlotLinear
from worker_proc.models.rope import RotaryEmbedding, apply_rope

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = SlotLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias)
        self.o_proj = SlotLinear(q_size, [cfg.hidden_size], cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [num_tokens, 1, head_dim]
        kv_cache: KVCacheLayer,
        meta: PagedAttentionMetadata,
        lora: LoraMapping | None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, lora)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        out = paged_attention_ref(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1), lora)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def forward(
        self,
        h: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: KVCacheLayer,
        meta: PagedAttentionMetadata,
        lora: LoraMapping | None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, kv_cache, meta, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim)


class LlamaForCausalLM(nn.Module):
    """The decoder plus lm_head. Parameter names follow HF except the fused qkv/gate_up."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = SlotLinear(cfg.hidden_size, [cfg.vocab_size], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_caches: list[KVCacheLayer],  # one per layer
        meta: PagedAttentionMetadata,
        lora_slots: torch.Tensor | None = None,  # [num_tokens] int, -1 = base model
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"{len(kv_caches)} KV cache layers for {len(self.model.layers)} model layers")
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        cos_sin = self.model.rotary.cos_sin(positions)
        lora = LoraMapping.from_slots(lora_slots) if lora_slots is not None else None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h = layer(h, cos_sin, kv_cache, meta, lora)
        return self.model.norm(h)

    @torch.inference_mode()
    def compute_logits(
        self,
        hidden: torch.Tensor,  # [num_sampled, hidden]
        lora_slots: torch.Tensor | None = None,  # [num_sampled]
    ) -> torch.Tensor:  # [num_sampled, vocab] float32
        lora = LoraMapping.from_slots(lora_slots) if lora_slots is not None else None
        return self.lm_head(hidden, lora).float()
