"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral; Qwen3-MoE and Mixtral, whose sparse
layers' MLP is models/moe.SparseMoeBlock) over a paged KV cache.

One forward takes a flat batch of tokens from many requests, described by one `StepInputs`
(worker_proc/step_inputs.py): attention finds each request's keys through its block table.
Each token carries its adapter slot (`lora_slots`, -1 = base model); every projection,
lm_head included, receives the batch's `LoraMapping` and adds its slot's LoRA delta.

Every op goes through `kernels.ops` (paged attention, fused residual-add + RMSNorm, in-place
RoPE from a cos/sin cache with the KV write, SiLU-and-mul, linear): Triton on CUDA in
bf16/fp16, the torch references otherwise. A projection's LoRA delta may come back unapplied
(`SlotLinear.forward_deferred`), for the op that consumes the output to add; so may a row-parallel
projection's all-reduce, which the residual-add RMSNorm after it performs (`reduce_add_rms_norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from ledgerserve.kernels import ops
from ledgerserve.worker_proc.lora.mapping import LoraMapping
from ledgerserve.worker_proc.models.config import ModelConfig
from ledgerserve.worker_proc.models.layers import (
    Deferred,
    GatedMLP,
    RMSNorm,
    SlotLinear,
    VocabEmbedding,
    reduce_add_rms_norm,
)
from ledgerserve.worker_proc.models.moe import SparseMoeBlock
from ledgerserve.worker_proc.models.rope import RotaryEmbedding
from ledgerserve.worker_proc.models.shard import o_shard, qkv_shard, vocab_shard
from ledgerserve.worker_proc.parallel import TpGroup
from ledgerserve.worker_proc.step_inputs import StepInputs

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, num_kv_heads, head_dim]
# reduce_add_rms_norm's call sites, each with its part of the fused all-reduce's buffer: the
# post-attention norm, then the next layer's input norm (or the final norm), alternating, and the
# first layer's input norm (the embedding's all-reduce), the step's first call, between the final
# norm and the post-attention norm (worker_proc/parallel.FUSED_NORM_PARTS)
AFTER_ATTENTION, AFTER_MLP, AFTER_EMBEDDING = 0, 1, 2


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TpGroup) -> None:
        """This rank's heads: q/k/v column-parallel, o row-parallel."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_local_heads, cfg.num_local_kv_heads, cfg.head_dim
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.qkv_proj = SlotLinear(cfg.hidden_size, [q_size, kv_size, kv_size], cfg.qkv_bias, qkv_shard(cfg), group)
        self.o_proj = SlotLinear(q_size, [cfg.hidden_size], cfg.o_bias, o_shard(cfg), group)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def _project_qkv(
        self,
        x: torch.Tensor,
        lora: LoraMapping | None,  # x: [num_tokens, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x, lora)  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        inputs: StepInputs,
        cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
        kv_cache: KVCacheLayer,
    ) -> Deferred:  # [num_tokens, hidden] and what the next norm owes it
        num_tokens = x.shape[0]
        q, k, v = self._project_qkv(x, inputs.lora)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        k_cache, v_cache = kv_cache
        ops.rope_and_write_kv(q, k, v, inputs.positions, cos_sin_cache, k_cache, v_cache, inputs.kv_slots)  # in place
        if inputs.is_decode:
            out = ops.paged_decode_attention(q, k_cache, v_cache, inputs.block_tables, inputs.seq_lens, self.scale)
        else:  # a mixed-step graph's grid is its tile table's (inputs.attn_tiles)
            meta = (inputs.block_tables, inputs.query_start_loc, inputs.seq_lens, self.scale, inputs.max_query_len)
            out = ops.paged_prefill_attention(q, k_cache, v_cache, *meta, inputs.attn_tiles)
        # out: [num_tokens, num_heads, head_dim]
        return self.o_proj.forward_deferred(out.reshape(num_tokens, -1), inputs.lora, AFTER_ATTENTION)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TpGroup, index: int) -> None:
        super().__init__()
        self.group = group
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: GatedMLP | SparseMoeBlock
        self.mlp = SparseMoeBlock(cfg, group) if cfg.is_sparse(index) else GatedMLP(cfg, group)

    def forward(
        self,
        h: Deferred,  # [num_tokens, hidden]: this layer's input delta (the previous down_proj's, or embeddings)
        residual: torch.Tensor | None,  # [num_tokens, hidden]; None for layer 0
        inputs: StepInputs,
        cos_sin_cache: torch.Tensor,
        kv_cache: KVCacheLayer,
    ) -> tuple[Deferred, torch.Tensor]:  # mlp output, residual
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        part = AFTER_EMBEDDING if residual is None else AFTER_MLP
        x, residual = reduce_add_rms_norm(self.group, h, residual, norm1, part)
        attn = self.self_attn(x, inputs, cos_sin_cache, kv_cache)
        x, residual = reduce_add_rms_norm(self.group, attn, residual, norm2, AFTER_ATTENTION)
        return self.mlp(x, inputs.lora, AFTER_MLP), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TpGroup) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, group)
        self.layers = nn.ModuleList(DecoderLayer(cfg, group, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """The decoder plus lm_head. Parameter names follow HF except the fused qkv/gate_up. Built from
    a rank's view (`cfg.shard(group.rank, group.size)`), it holds that rank's shard of every weight."""

    def __init__(self, cfg: ModelConfig, group: TpGroup | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.group = group or TpGroup()
        if (cfg.tp_rank, cfg.tp_size) != (self.group.rank, self.group.size):
            raise ValueError(
                f"model view of rank {cfg.tp_rank}/{cfg.tp_size} for group rank {self.group.rank}/{self.group.size}"
            )
        self.model = LlamaModel(cfg, self.group)
        self.lm_head = SlotLinear(cfg.hidden_size, [cfg.local_vocab_size], False, vocab_shard(cfg), self.group)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv_caches: list[KVCacheLayer]) -> torch.Tensor:  # [num_tokens, hidden]
        """kv_caches: one per layer."""
        if len(kv_caches) != len(self.model.layers):
            raise ValueError(f"{len(kv_caches)} KV cache layers for {len(self.model.layers)} model layers")
        h = self.model.embed_tokens(inputs.input_ids)  # [num_tokens, hidden]
        cos_sin_cache = self.model.rotary.cos_sin_cache(h.y.device)
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            h, residual = layer(h, residual, inputs, cos_sin_cache, kv_cache)
        assert residual is not None
        return reduce_add_rms_norm(self.group, h, residual, self.model.norm, AFTER_MLP)[0]

    @torch.inference_mode()
    def compute_logits(
        self,
        hidden: torch.Tensor,  # [num_sampled, hidden]
        lora: LoraMapping | None = None,  # of the rows of `hidden`
    ) -> torch.Tensor:  # [num_sampled, vocab] float32
        logits = self.lm_head(hidden, lora)  # [num_sampled, local_vocab]: this rank's vocabulary rows
        if self.group.size > 1:  # gathered and cast in one copy
            logits = self.group.all_gather(logits, torch.float32)[:, : self.cfg.vocab_size]  # [num_sampled, vocab]
        return logits.float().contiguous()
