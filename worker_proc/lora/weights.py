"""Stacked per-slot LoRA buffers of one (possibly fused) projection."""

from __future__ import annotations

import torch

from ledgerserve.kernels import ops
from ledgerserve.worker_proc.lora.mapping import LoraMapping

SliceWeights = tuple[torch.Tensor, torch.Tensor, float]  # A [rank, in], B [out_slice, rank], scaling


class LoraWeights:
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
    ) -> None:
        """`a`: zeroed storage for A that the caller owns (a view stacked under the base weight), or None."""
        num_slices = len(output_sizes)
        self.output_sizes = list(output_sizes)
        a_shape = (max_loras, num_slices, max_rank, in_features)
        if a is not None and (tuple(a.shape) != a_shape or not a.is_contiguous()):
            raise ValueError(f"A storage of shape {tuple(a.shape)} is not a contiguous {a_shape}")
        self.a = torch.zeros(a_shape, dtype=dtype, device=device) if a is None else a
        # [max_loras, num_slices, max_out_slice, max_rank], stored out-major so the expand reads whole output rows
        self.b = torch.zeros(max_loras, num_slices, max_rank, max(output_sizes), dtype=dtype, device=device).transpose(
            2, 3
        )
        self.ranks = torch.zeros(max_loras, num_slices, dtype=torch.long, device=device)
        self.scalings = torch.zeros(max_loras, num_slices, dtype=torch.float32, device=device)
        # host copies of ranks / scalings, kept in step with the device ones: no sync per step
        self.rank_table: list[list[int]] = [[0] * num_slices for _ in range(max_loras)]
        self.scale_table: list[list[float]] = [[0.0] * num_slices for _ in range(max_loras)]

    @property
    def max_rank(self) -> int:
        return self.a.shape[2]

    def apply(self, x: torch.Tensor, y: torch.Tensor, mapping: LoraMapping) -> None:
        """y += LoRA delta of each token's slot. x: [num_tokens, in], y: [num_tokens, out]."""
        if mapping.grouped is not None:
            self._apply_grouped(x, y, mapping.grouped)
            return
        if ops.use_triton_lora(x):
            self._apply_triton(x, y, mapping)
            return
        if mapping.use_segments:
            buf = ops.lora_shrink_segments(
                x, self.a, self.ranks, mapping.seg_starts, mapping.seg_slots, self.rank_table
            )
            ops.lora_expand_segments(
                y,
                buf,
                self.b,
                self.ranks,
                self.scalings,
                self.output_sizes,
                mapping.seg_starts,
                mapping.seg_slots,
                self.rank_table,
                self.scale_table,
            )
            return
        rank = self.batch_rank(mapping.slots)
        if rank == 0:
            return
        buf = ops.lora_shrink_tokens(x, self.a, self.ranks, mapping.token_slots, rank)
        ops.lora_expand_tokens(y, buf, self.b, self.ranks, self.scalings, self.output_sizes, mapping.token_slots, rank)

    def _apply_triton(self, x: torch.Tensor, y: torch.Tensor, mapping: LoraMapping) -> None:
        """Triton: segment kernels when the batch is prefill-like and its runs are on the device."""
        if not mapping.in_graph and self.batch_rank(mapping.slots) == 0:
            return
        if mapping.use_segments and mapping.device_segments is not None:
            starts, seg_slots = mapping.device_segments
            buf = ops.lora_shrink_segments(x, self.a, self.ranks, starts, seg_slots, max_seg_len=mapping.max_seg_len)
            ops.lora_expand_segments(
                y,
                buf,
                self.b,
                self.ranks,
                self.scalings,
                self.output_sizes,
                starts,
                seg_slots,
                max_seg_len=mapping.max_seg_len,
            )
            return
        buf = ops.lora_shrink_tokens(x, self.a, self.ranks, mapping.token_slots)
        ops.lora_expand_tokens(y, buf, self.b, self.ranks, self.scalings, self.output_sizes, mapping.token_slots)

    def expand_stacked(self, y: torch.Tensor, h: torch.Tensor, grouped: tuple[torch.Tensor, ...]) -> None:
        """Decode, shrink already done for every slot: h [num_tokens, max_loras, num_slices, max_rank]."""
        order, tile_starts, tile_slots = grouped
        ops.lora_expand_stacked(
            y, h, self.b, self.ranks, self.scalings, self.output_sizes, order, tile_starts, tile_slots
        )

    def _apply_grouped(self, x: torch.Tensor, y: torch.Tensor, grouped: tuple[torch.Tensor, ...]) -> None:
        """Decode: tokens grouped by slot, each tile of one adapter reads its A / B once."""
        order, tile_starts, tile_slots = grouped
        buf = ops.lora_shrink_grouped(x, self.a, self.ranks, order, tile_starts, tile_slots)
        ops.lora_expand_grouped(
            y, buf, self.b, self.ranks, self.scalings, self.output_sizes, order, tile_starts, tile_slots
        )

    def batch_rank(self, slots: tuple[int, ...]) -> int:
        """The largest real rank over `slots` and this layer's slices (host-side)."""
        return max((max(self.rank_table[slot]) for slot in slots), default=0)

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
