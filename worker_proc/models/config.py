"""Model hyper-parameters read from a HF `config.json` (transformers 4.x or 5.x layout)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any

from ledgerserve.shared.moe_layers import MOE_ARCHITECTURES, sparse_mlp_layers

DENSE_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
SUPPORTED_ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: `top_k` of `num_experts` experts per token, each a gated MLP of
    `intermediate_size`; the router's softmax over every expert, its top-k renormalised to sum
    to 1 where `renormalize` (Mixtral always, Qwen3-MoE with norm_topk_prob)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]  # the layers with a sparse MLP; the rest have a dense one


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2, Llama attention_bias)
    o_bias: bool  # bias on o_proj (Llama attention_bias only)
    mlp_bias: bool
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None  # None: full attention
    max_position_embeddings: int
    moe: MoeConfig | None = None
    tp_rank: int = 0  # which shard of the tensor-parallel group this view describes (shard())
    tp_size: int = 1

    def shard(self, rank: int, size: int) -> ModelConfig:
        """The view of tensor-parallel rank `rank` of `size`: the modules built from it hold that
        rank's heads, MLP columns and vocabulary rows. ValueError names a size that does not divide."""
        if not 0 <= rank < size:
            raise ValueError(f"tensor-parallel rank {rank} is outside [0, {size})")
        if self.num_heads % size:
            raise ValueError(f"num_attention_heads {self.num_heads} is not divisible by tensor_parallel_size {size}")
        if self.num_kv_heads % size and size % self.num_kv_heads:
            raise ValueError(
                f"num_key_value_heads {self.num_kv_heads} and tensor_parallel_size {size}: neither divides the other"
            )
        if self.intermediate_size % size:
            raise ValueError(
                f"intermediate_size {self.intermediate_size} is not divisible by tensor_parallel_size {size}"
            )
        if self.moe is not None and self.moe.intermediate_size % size:
            raise ValueError(
                f"the experts' intermediate size {self.moe.intermediate_size} is not divisible by "
                f"tensor_parallel_size {size}"
            )
        return replace(self, tp_rank=rank, tp_size=size)

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads of this rank: replicated (one per rank) when the ranks outnumber them."""
        return max(1, self.num_kv_heads // self.tp_size)

    @property
    def first_kv_head(self) -> int:
        """The first KV head this rank holds: the one its q heads use when KV heads are replicated."""
        return self.tp_rank * self.num_kv_heads // self.tp_size

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.tp_size

    @property
    def local_expert_intermediate_size(self) -> int:
        """Each expert's MLP columns on this rank: experts are sharded along their intermediate size."""
        assert self.moe is not None
        return self.moe.intermediate_size // self.tp_size

    @property
    def local_vocab_size(self) -> int:
        """Vocabulary rows per rank: the vocabulary padded to a multiple of tp_size, split."""
        return -(-self.vocab_size // self.tp_size)

    @property
    def first_vocab_row(self) -> int:
        return self.tp_rank * self.local_vocab_size


def load_model_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in {model_dir!r}")
    with open(path, encoding="utf-8") as f:
        return parse_model_config(json.load(f))


def parse_model_config(cfg: dict[str, Any]) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(f"unsupported architectures {archs!r}; supported: {SUPPORTED_ARCHITECTURES}")
    num_heads = int(cfg["num_attention_heads"])
    hidden_size = int(cfg["hidden_size"])
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads {num_heads} not a multiple of num_key_value_heads {num_kv_heads}")
    is_qwen2 = arch == "Qwen2ForCausalLM"
    llama_bias = bool(cfg.get("attention_bias", False)) and not is_qwen2
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=parse_rope(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or llama_bias,
        o_bias=llama_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=_sliding_window(cfg, arch),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        moe=parse_moe(cfg, arch),
    )


def parse_moe(cfg: dict[str, Any], arch: str) -> MoeConfig | None:
    """The sparse MLP of a MoE architecture, as transformers reads its config (its layers:
    shared/moe_layers.py)."""
    if arch not in MOE_ARCHITECTURES:
        return None
    num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    top_k = int(cfg["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} is not within the {num_experts} experts")
    sparse = sparse_mlp_layers(cfg)
    if arch == "MixtralForCausalLM":
        return MoeConfig(num_experts, top_k, int(cfg["intermediate_size"]), True, sparse)
    renormalize = bool(cfg.get("norm_topk_prob", False))
    return MoeConfig(num_experts, top_k, int(cfg["moe_intermediate_size"]), renormalize, sparse)


def parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    """transformers 5 stores `rope_parameters` (theta inside); 4.x `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def load_eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json, else config.json (int or list); sorted, unique."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if eos is None:
            continue
        ids = [eos] if isinstance(eos, int) else list(eos)
        return sorted({int(i) for i in ids})
    return []


def _sliding_window(cfg: dict[str, Any], arch: str) -> int | None:
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window"):
        return None
    return int(window)
