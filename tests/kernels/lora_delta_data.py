"""A pending LoRA delta (kernels/lora_types.LoraDelta) laid out as the worker holds it, and the
delta it stands for computed token by token in float64."""

from __future__ import annotations

import torch

from ledgerserve.kernels.lora_types import LoraDelta, SlotWeights

SLOTS = [0, -1, 3, 1, 1, 2, -1, 0, 3]  # slot 1 does not target slice 0; -1: base tokens


def make_delta(
    output_sizes: list[int],
    dtype: torch.dtype,
    device: str,
    slots: list[int] = SLOTS,
    max_loras: int = 5,
    num_slots: int = 4,
    max_rank: int = 13,
    seed: int = 0,
) -> LoraDelta:
    """h a strided view out of a wider GEMM output, B stored out-major, ranks 1..max_rank, both zero
    past each slot's rank."""
    gen = torch.Generator().manual_seed(seed)
    num_slices = len(output_sizes)
    wide = torch.randn(len(slots), 3 + num_slots * num_slices * max_rank, generator=gen)
    h = wide.to(dtype).to(device)[:, 3:].unflatten(1, (num_slots, num_slices, max_rank))
    b = torch.randn(max_loras, num_slices, max_rank, max(output_sizes), generator=gen) * 0.3
    ranks = torch.randint(1, max_rank + 1, (max_loras, num_slices), generator=gen)
    ranks[1, 0] = 0
    scalings = torch.rand(max_loras, num_slices, generator=gen) * 2
    past_rank = torch.arange(max_rank) >= ranks[..., None]  # [max_loras, num_slices, max_rank]: zero there, as stored
    b = b.masked_fill(past_rank[..., None], 0.0)
    h.masked_fill_(past_rank[:num_slots].to(device), 0.0)  # in place: h stays a strided view
    a = torch.zeros(max_loras, num_slices, max_rank, 0, dtype=dtype, device=device)  # its shrink is h already
    weights = SlotWeights.of(
        a, b.to(dtype).to(device).transpose(2, 3), ranks.to(device), scalings.to(device), output_sizes
    )
    return LoraDelta(h, weights, torch.tensor(slots, device=device))


def naive_delta(delta: LoraDelta, output_sizes: list[int]) -> torch.Tensor:  # [num_tokens, sum(output_sizes)] f64
    out = torch.zeros(delta.h.shape[0], sum(output_sizes), dtype=torch.float64)
    h, b = delta.h.cpu().double(), delta.weights.b.cpu().double()
    for t, slot in enumerate(delta.token_slots.tolist()):
        lo = 0
        for s, size in enumerate(output_sizes):
            rank = int(delta.weights.ranks[slot, s]) if slot >= 0 else 0
            scale = float(delta.weights.scalings[slot, s]) if slot >= 0 else 0.0
            out[t, lo : lo + size] = scale * (h[t, slot, s, :rank] @ b[slot, s, :size, :rank].T)
            lo += size
    return out
