"""What an adapter is checked against and what reading one yields: the base model's shapes,
the refusal (`AdapterError`), and the manifest of a readable adapter."""

from __future__ import annotations

from dataclasses import dataclass

from ledgerserve.shared.moe_layers import expert_shapes, per_expert_names, sparse_mlp_layers

TARGET_KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"


class AdapterError(Exception):
    """A refused adapter: `code` is the HTTP status (400 bad adapter, 404 no such path)."""

    def __init__(self, message: str, code: int = 400, param: str = "lora_path") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must agree with: the base model's module names and shapes."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int  # num_heads * head_dim
    kv_size: int  # num_kv_heads * head_dim
    vocab_size: int
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is a mixture of experts: no MLP targets there
    num_experts: int = 0  # of each sparse layer
    expert_intermediate_size: int = 0  # of one expert
    # transformers 4's names of an expert's modules: (sparse block, gate, up, down)
    per_expert_names: tuple[str, str, str, str] = ("mlp", "gate_proj", "up_proj", "down_proj")

    @staticmethod
    def from_hf_config(cfg: dict) -> BaseShapes:
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return BaseShapes(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            q_size=cfg["num_attention_heads"] * head_dim,
            kv_size=cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim,
            vocab_size=cfg["vocab_size"],
            sparse_layers=sparse_mlp_layers(cfg),
            num_experts=expert_shapes(cfg)[0],
            expert_intermediate_size=expert_shapes(cfg)[1],
            per_expert_names=per_expert_names(cfg),
        )

    def in_out(self, kind: str) -> tuple[int, int]:
        """(in_features, out_features) of one projection."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_size),
            "k_proj": (h, self.kv_size),
            "v_proj": (h, self.kv_size),
            "o_proj": (self.q_size, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
            "lm_head": (h, self.vocab_size),
        }[kind]

    def module_names(self) -> list[tuple[str, str, int]]:
        """(full module path, kind, layer) of every projection an adapter may target."""
        names = []
        for layer in range(self.num_layers):
            for kind in TARGET_KINDS[:4]:
                names.append((f"model.layers.{layer}.self_attn.{kind}", kind, layer))
            if layer in self.sparse_layers:
                continue  # the experts take no adapter (yet): an adapter for them is refused
            for kind in TARGET_KINDS[4:7]:
                names.append((f"model.layers.{layer}.mlp.{kind}", kind, layer))
        names.append(("lm_head", "lm_head", -1))
        return names


@dataclass(frozen=True)
class LoraModule:
    name: str  # full module path in the base model, e.g. model.layers.3.mlp.up_proj
    kind: str  # one of TARGET_KINDS
    layer: int  # -1 for lm_head
    rank: int
    scaling: float
    a_key: str  # safetensors key of A: [rank, in_features]
    b_key: str  # safetensors key of B: [out_features, rank]


@dataclass(frozen=True)
class AdapterManifest:
    path: str  # real path of the adapter directory
    modules: tuple[LoraModule, ...]
    num_bytes: int  # size of the weights file
    max_rank: int
    weights_path: str  # real path of the weights file that was checked (links followed)
    content_sha256: str = ""  # shared.adapter_digest of both files as read; "": the weights were not read

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(k for k in TARGET_KINDS if any(m.kind == k for m in self.modules))
