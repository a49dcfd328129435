"""Building blocks of the Llama-family decoder.

Every projection is a `SlotLinear`: its forward takes the batch's `LoraMapping` (each
token's adapter slot, -1 = base model) and, when LoRA is enabled, adds each slot's delta
from its stacked buffers (`self.lora`), for fused qkv, o, gate_up, down and lm_head alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import ops
from worker_proc.lora.mapping import LoraMapping
from worker_proc.lora.weights import LoraWeights


class SlotLinear(nn.Module):
    """y = x W^T + b, with the output split into named shards (fused projections).

    `output_sizes` lists the shards (e.g. [q, k, v]); checkpoint tensors load into
    their row range with `load_shard`.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        out_features = sum(output_sizes)
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.lora: LoraWeights | None = None  # set by LoraManager when LoRA is enabled

    def forward(self, x: torch.Tensor, lora: LoraMapping | None = None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> [num_tokens, out_features]
        y = F.linear(x, self.weight, self.bias)
        if self.lora is not None and lora is not None:
            self.lora.apply(x, y, lora)
        return y

    def load_shard(self, name: str, shard: int, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (`name` is 'weight' or 'bias') into shard `shard`'s rows."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"checkpoint has a {name} this layer does not")
        start = sum(self.output_sizes[:shard])
        rows = param.data[start : start + self.output_sizes[shard]]
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name} shard {shard}: {tuple(tensor.shape)} vs {tuple(rows.shape)}")
        rows.copy_(tensor)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]; normalise in float32 like HF, then cast back before the weight
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = SlotLinear(hidden_size, [intermediate_size, intermediate_size], bias)
        self.down_proj = SlotLinear(intermediate_size, [hidden_size], bias)

    def forward(self, x: torch.Tensor, lora: LoraMapping | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)  # [num_tokens, hidden]

    def forward_fast(self, x: torch.Tensor, lora: LoraMapping | None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, lora)  # [num_tokens, 2 * intermediate]
        return self.down_proj(ops.silu_and_mul(gate_up), lora)  # [num_tokens, hidden]
