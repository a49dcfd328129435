"""Stacked per-slot LoRA buffers of one (possibly fused) projection."""

from __future__ import annotations

from typing import Protocol

import torch

from ledgerserve.kernels import ops
from ledgerserve.kernels.lora_types import LoraLayout, SlotWeights


class LayerShard(Protocol):
    """The part of a base layer's checkpoint tensors a tensor-parallel rank holds
    (worker_proc/models/shard.LayerShard): its slots hold the same part of each adapter tensor."""

    @property
    def rows(self) -> tuple[tuple[int, int], ...]: ...  # per output slice: rows [start, stop) held

    @property
    def cols(self) -> tuple[int, int]: ...  # input columns [start, stop) held

    @property
    def in_full(self) -> int: ...

    @property
    def out_full(self) -> tuple[int, ...]: ...


SliceWeights = tuple[torch.Tensor, torch.Tensor, float]  # A [rank, in], B [out_slice, rank], scaling


class LoraWeights(SlotWeights):
    """A, B, ranks and scalings of every slot for one layer with `len(output_sizes)` slices.
    Padding past a slot's rank is zero; a slice the slot's adapter does not target has rank 0."""

    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        in_features: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device,
        a: torch.Tensor | None = None,
        shard: LayerShard | None = None,
    ) -> None:
        """`a`: zeroed storage for A that the caller owns (a view stacked under the base weight), or None.
        `shard`: the part of the base layer this rank holds (models/shard.py), which decides the part
        of each adapter tensor the slots hold; None: the whole layer."""
        num_slices = len(output_sizes)
        a_shape = (max_loras, num_slices, max_rank, in_features)
        if a is not None and (tuple(a.shape) != a_shape or not a.is_contiguous()):
            raise ValueError(f"A storage of shape {tuple(a.shape)} is not a contiguous {a_shape}")
        super().__init__(
            torch.zeros(a_shape, dtype=dtype, device=device) if a is None else a,
            # [max_loras, num_slices, max_out_slice, max_rank], stored out-major so the expand reads whole output rows
            torch.zeros(max_loras, num_slices, max_rank, max(output_sizes), dtype=dtype, device=device).transpose(2, 3),
            torch.zeros(max_loras, num_slices, dtype=torch.long, device=device),
            torch.zeros(max_loras, num_slices, dtype=torch.float32, device=device),
            list(output_sizes),
            [[0] * num_slices for _ in range(max_loras)],
            [[0.0] * num_slices for _ in range(max_loras)],
        )
        self.shard = shard

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]

    def apply(self, x: torch.Tensor, y: torch.Tensor, layout: LoraLayout) -> None:
        """y += LoRA delta of each token's slot, by the kernels of `layout` (worker_proc/lora/layout.choose).
        x: [num_tokens, in], y: [num_tokens, out]."""
        ops.lora_expand(y, ops.lora_shrink(x, self, layout), self, layout)

    def check_slice(self, s: int, weights: SliceWeights) -> None:
        """Raise ValueError if one slice's tensors do not fit this layer's buffers."""
        a, b, _ = weights
        if a.dim() != 2:
            raise ValueError(f"LoRA A must be 2-D, got shape {tuple(a.shape)}")
        rank = a.shape[0]
        want_a, want_b = (rank, self.a.shape[3]), (self.output_sizes[s], rank)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise ValueError(
                f"LoRA tensors of shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit "
                f"slice {s} (A {want_a}, B {want_b})"
            )
        if not 0 < rank <= self.max_rank:
            raise ValueError(f"LoRA rank {rank} is outside [1, {self.max_rank}]")

    def load_slot(self, slot: int, slices: list[SliceWeights | None]) -> None:
        """Copy one adapter's slices into `slot`, zeroing the rest of the slot first."""
        if len(slices) != len(self.output_sizes):
            raise ValueError(f"{len(slices)} slices for a layer with {len(self.output_sizes)}")
        for s, weights in enumerate(slices):
            if weights is not None:
                self.check_slice(s, weights)
        self.clear_slot(slot)
        for s, weights in enumerate(slices):
            if weights is None:
                continue
            a, b, scaling = weights
            rank = a.shape[0]
            self.a[slot, s, :rank].copy_(a, non_blocking=True)  # [rank, in]
            self.b[slot, s, : b.shape[0], :rank].copy_(b, non_blocking=True)  # [out_slice, rank]
            self.ranks[slot, s] = rank
            self.scalings[slot, s] = scaling
            self.rank_table[slot][s] = rank
            self.scale_table[slot][s] = float(torch.tensor(scaling, dtype=torch.float32))  # as stored

    def clear_slot(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.ranks[slot].zero_()
        self.scalings[slot].zero_()
        self.rank_table[slot] = [0] * len(self.output_sizes)
        self.scale_table[slot] = [0.0] * len(self.output_sizes)
