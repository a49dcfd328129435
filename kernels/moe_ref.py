"""torch reference of a sparse MoE MLP: the router's top-k and the experts' gated MLPs, computed
as transformers computes Qwen3-MoE and Mixtral (softmax over every expert in float32, top-k,
renormalised where the model does, then each expert over the tokens routed to it, its output
scaled by the token's routing weight and summed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k]
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden]
    out = torch.zeros_like(x)
    weights = weights.to(x.dtype)
    hit = torch.unique(ids).tolist()
    for expert in hit:
        tokens, slot = torch.where(ids == expert)  # [n], [n]
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)  # [n, intermediate] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, hidden]
        out.index_add_(0, tokens, y * weights[tokens, slot, None])
    return out
