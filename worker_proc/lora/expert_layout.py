"""Expert LoRA from PEFT's `target_parameters` form, split into one A and one B per expert.

PEFT (0.19 and later) wraps a MoE layer's fused 3-D expert parameters: `mlp.experts.base_layer`
holds gate_up_proj's LoRA and `mlp.experts` down_proj's (the wrappers nest in that order). Each A
is expert-major, [r * E, in]: rows e * r .. e * r + r - 1 are expert e's. Each B is interleaved,
[out, r * E]: column k * E + e is column k of expert e's B. Expert e's delta is then
scaling * B_e @ A_e, of its parameter's [out, in] (gate_up: [2 * intermediate, hidden]; down:
[hidden, intermediate]). Splitting B as if it were expert-major too gives another expert's
columns, silently: a test holds the split against PEFT's own forward.
"""

from __future__ import annotations

import torch


def split_experts(
    a: torch.Tensor,  # [r * E, in]: expert-major
    b: torch.Tensor,  # [out, r * E]: interleaved
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # A [E, r, in], B [E, out, r]
    rank_x_experts, num_in = a.shape
    num_out = b.shape[0]
    if rank_x_experts % num_experts or b.shape[1] != rank_x_experts:
        raise ValueError(
            f"expert LoRA A {tuple(a.shape)} and B {tuple(b.shape)} do not split into {num_experts} experts"
        )
    rank = rank_x_experts // num_experts
    per_expert_a = a.reshape(num_experts, rank, num_in)  # [E, r, in]
    per_expert_b = b.reshape(num_out, rank, num_experts).permute(2, 0, 1)  # [E, out, r]
    return per_expert_a, per_expert_b


def expert_deltas(a: torch.Tensor, b: torch.Tensor, num_experts: int, scaling: float) -> torch.Tensor:
    """Every expert's delta, [E, out, in], as its fused parameter is laid out."""
    per_expert_a, per_expert_b = split_experts(a, b, num_experts)
    return scaling * torch.bmm(per_expert_b, per_expert_a)


def stack_experts(
    pairs: list[tuple[torch.Tensor, torch.Tensor] | None],  # per expert: A [r, in], B [out, r]; None: left alone
    rank: int,
    num_in: int,
    num_out: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # A [E, r, in], B [E, out, r]
    """The per-expert 2-D form (transformers 4's expert modules) in the same layout as
    `split_experts`: an expert the adapter leaves alone gets zeros, a delta of zero."""
    per_expert_a = torch.zeros(len(pairs), rank, num_in)
    per_expert_b = torch.zeros(len(pairs), num_out, rank)
    for e, pair in enumerate(pairs):
        if pair is not None:
            per_expert_a[e], per_expert_b[e] = pair
    return per_expert_a, per_expert_b
