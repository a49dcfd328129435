"""A sparse MoE MLP (Qwen3-MoE, Mixtral): a router and `num_experts` gated MLPs, of which each
token runs its top-k (kernels.ops.fused_moe).

Under tensor parallelism every rank holds every expert, each cut along its intermediate size
(Megatron's rule for a dense MLP, per expert): gate/up rows and down columns of this rank's part.
The router is replicated. Each rank's output is a partial sum of the experts' down projections,
owed the one all-reduce per layer a dense MLP's down projection owes (models/layers.Deferred).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from ledgerserve.kernels import ops
from ledgerserve.worker_proc.models.config import ModelConfig
from ledgerserve.worker_proc.models.layers import Deferred
from ledgerserve.worker_proc.parallel import TpGroup

GATE, UP, DOWN = 0, 1, 2  # an expert weight's part, as checkpoints name them one by one
_PARTS = {"gate_proj": GATE, "up_proj": UP, "down_proj": DOWN, "w1": GATE, "w3": UP, "w2": DOWN}  # Qwen3-MoE, Mixtral
_PER_EXPERT = re.compile(
    r"^(.+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_FUSED = re.compile(r"^(.+)\.mlp\.experts\.(gate_up_proj|down_proj)$")  # transformers 5's in-memory form


def checkpoint_name(name: str) -> str:
    """A checkpoint tensor's name in our model's terms: Mixtral's block_sparse_moe.gate is mlp.gate."""
    return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


def expert_tensor(name: str) -> tuple[str, int, int] | tuple[str, None, str] | None:
    """(Experts module path, expert, part) of a per-expert checkpoint tensor, (path, None, its
    name) of a fused one; None for any other tensor."""
    if (m := _PER_EXPERT.match(name)) is not None:
        return f"{m.group(1)}.mlp.experts", int(m.group(2)), _PARTS[m.group(3)]
    if (m := _FUSED.match(name)) is not None:
        return f"{m.group(1)}.mlp.experts", None, m.group(2)
    return None


class Experts(nn.Module):
    """Every expert's weights, fused as transformers 5 holds them: w13 = [gate; up] rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        num, local = cfg.moe.num_experts, cfg.local_expert_intermediate_size
        self.full_intermediate, self.hidden = cfg.moe.intermediate_size, cfg.hidden_size
        self.first_col = cfg.tp_rank * local  # this rank's intermediate columns start here
        self.w13 = nn.Parameter(torch.zeros(num, 2 * local, cfg.hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(num, cfg.hidden_size, local), requires_grad=False)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    def checkpoint_shape(self, part: int) -> tuple[int, int]:
        """One expert's checkpoint tensor of `part` (gate, up: [intermediate, hidden]; down the transpose)."""
        i, h = self.full_intermediate, self.hidden
        return (h, i) if part == DOWN else (i, h)

    def load_expert(self, expert: int, part: int, tensor: torch.Tensor) -> None:
        """This rank's columns of one expert's checkpoint tensor."""
        local = self.w2.shape[-1]
        cols = slice(self.first_col, self.first_col + local)
        if part == DOWN:
            self.w2.data[expert].copy_(tensor[:, cols])
        else:
            self.w13.data[expert, part * local : (part + 1) * local].copy_(tensor[cols])

    def fused_shape(self, name: str) -> tuple[int, int, int]:
        """A transformers-5 fused tensor's shape: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
        i, h = self.full_intermediate, self.hidden
        return (self.num_experts, h, i) if name == "down_proj" else (self.num_experts, 2 * i, h)

    def load_fused(self, name: str, tensor: torch.Tensor) -> None:
        for expert in range(self.num_experts):
            if name == "down_proj":
                self.load_expert(expert, DOWN, tensor[expert])
            else:
                gate, up = tensor[expert].chunk(2, dim=0)
                self.load_expert(expert, GATE, gate)
                self.load_expert(expert, UP, up)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, group: TpGroup) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.group = group
        self.top_k, self.renormalize = cfg.moe.top_k, cfg.moe.renormalize
        self.gate = nn.Linear(cfg.hidden_size, cfg.moe.num_experts, bias=False)  # the router, replicated
        self.gate.weight.requires_grad_(False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, lora: object | None, part: int | None = None) -> Deferred:
        """[num_tokens, hidden], this rank's partial sum at tensor parallel > 1. `lora` is unused:
        adapters do not target experts (shared/adapter_types.BaseShapes leaves them out)."""
        router_logits = ops.linear(x, self.gate.weight)  # [num_tokens, num_experts]
        y = ops.fused_moe(x, router_logits, self.experts.w13, self.experts.w2, self.top_k, self.renormalize)
        return Deferred(y, partial=y if self.group.size > 1 else None)
