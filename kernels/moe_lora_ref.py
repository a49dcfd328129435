"""torch reference of a sparse MoE MLP with expert LoRA: kernels/moe_ref.fused_moe_ref, where each
token also adds its adapter's delta to every expert it is routed to.

An adapter's expert LoRA is held per projection (gate, up, down) and per expert, the layout every
format converts to (PEFT's `target_parameters`, per-expert 2-D, shared-outer): A [slots, E, r, in],
B [slots, E, out, r], a scaling per slot, zero past a slot's rank and for a slot that does not
target the projection. For the (token t, choice k) pair on expert e, with s the token's slot:

    gate = x W_gate[e]^T + scaling_gate[s] * (x A_gate[s, e]^T) B_gate[s, e]^T     (up alike)
    y    = act W_down[e]^T + scaling_down[s] * (act A_down[s, e]^T) B_down[s, e]^T,  act = silu(gate) * up
    out[t] += routing weight[t, k] * y

A token of slot -1 (the base model) adds nothing. PEFT's `target_parameters` form has one A for
gate_up and one B over its [gate; up] rows: it converts to the same A for gate and up and B's two
halves (`from_fused_gate_up`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ExpertLora:
    """One projection's LoRA over a MoE layer's experts, every slot."""

    a: torch.Tensor  # [num_slots, num_experts, rank, in]
    b: torch.Tensor  # [num_slots, num_experts, out, rank]
    scaling: torch.Tensor  # [num_slots] float32

    def delta(self, x: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [n, in] of rows on (slot, expert) pairs [n], [n] (slot >= 0) -> [n, out]."""
        a, b = self.a[slots, experts], self.b[slots, experts]  # [n, r, in], [n, out, r]
        shrunk = torch.bmm(a, x.unsqueeze(-1))  # [n, r, 1]
        return torch.bmm(b, shrunk).squeeze(-1) * self.scaling[slots, None].to(x.dtype)


@dataclass(frozen=True)
class ExpertLoras:
    gate: ExpertLora
    up: ExpertLora
    down: ExpertLora

    @staticmethod
    def from_fused_gate_up(gate_up: ExpertLora, down: ExpertLora) -> ExpertLoras:
        """PEFT's target_parameters form: one A for [gate; up], B over both halves' rows."""
        gate_b, up_b = gate_up.b.chunk(2, dim=2)  # [S, E, intermediate, r] each
        return ExpertLoras(
            ExpertLora(gate_up.a, gate_b, gate_up.scaling), ExpertLora(gate_up.a, up_b, gate_up.scaling), down
        )


def fused_moe_lora_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]: gate rows, then up rows
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k]
    token_slots: torch.Tensor,  # [num_tokens] int64, -1 = base
    loras: ExpertLoras,
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = ids.shape
    tokens = torch.arange(num_tokens, device=x.device).repeat_interleave(top_k)  # [num_pairs]
    experts, slots = ids.reshape(-1), token_slots[tokens]  # [num_pairs] each
    xs = x[tokens]  # [num_pairs, hidden]
    gate, up = torch.bmm(w13[experts], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)  # [num_pairs, intermediate]
    adapted = slots >= 0
    if adapted.any():
        rows, s, e = adapted.nonzero().squeeze(-1), slots[adapted], experts[adapted]
        gate = gate.index_add(0, rows, loras.gate.delta(xs[rows], s, e))
        up = up.index_add(0, rows, loras.up.delta(xs[rows], s, e))
    act = F.silu(gate) * up  # [num_pairs, intermediate]
    y = torch.bmm(w2[experts], act.unsqueeze(-1)).squeeze(-1)  # [num_pairs, hidden]
    if adapted.any():
        y = y.index_add(0, rows, loras.down.delta(act[rows], s, e))
    y = y * weights.reshape(-1, 1).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, y)
