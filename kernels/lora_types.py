"""What the multi-LoRA ops take (kernels/lora_ref.py has their contract, kernels/lora.py the
Triton kernels): a layer's stacked per-slot weights, and the batch's tokens in one of three
layouts of token -> slot (-1 = base model), plus the host-side grouping decode uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_TILE = 16  # rows per tile of the grouped layout (the smallest tl.dot tile)


@dataclass(eq=False)
class SlotWeights:
    """One (possibly fused) layer's LoRA buffers of every slot, zero past each slot's rank.
    `rank_table` / `scale_table` are host copies of `ranks` / `scalings`, kept in step with
    them, so that no op reads the device to learn a rank."""

    a: torch.Tensor  # [max_loras, num_slices, max_rank, in]
    b: torch.Tensor  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor  # [max_loras, num_slices] int, real rank (0 = slice not targeted)
    scalings: torch.Tensor  # [max_loras, num_slices] float32
    output_sizes: list[int]  # width of each slice; slice s writes columns from sum(output_sizes[:s])
    rank_table: list[list[int]]
    scale_table: list[list[float]]

    @staticmethod
    def of(
        a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor, output_sizes: list[int]
    ) -> SlotWeights:
        """From the tensors alone (reads ranks and scalings back: a sync on CUDA)."""
        return SlotWeights(a, b, ranks, scalings, list(output_sizes), ranks.tolist(), scalings.tolist())

    def batch_rank(self, slots: tuple[int, ...]) -> int:
        """The largest real rank over `slots` and this layer's slices (host-side)."""
        return max((max(self.rank_table[slot]) for slot in slots), default=0)


@dataclass(frozen=True)
class Segments:
    """Prefill: runs of tokens sharing one slot."""

    starts: torch.Tensor  # [num_segments + 1] int, token offsets
    slots: torch.Tensor  # [num_segments] int, -1 = base
    max_len: int | None = None  # the longest run; read from `starts` (a sync on CUDA) when None


@dataclass(frozen=True)
class Tokens:
    """Each token its own slot."""

    slots: torch.Tensor  # [num_tokens] int, -1 = base
    used: tuple[int, ...] | None = None  # distinct slots >= 0, host-side; read from `slots` when None


@dataclass(frozen=True)
class Tiles:
    """Decode, grouped (CUDA-graph friendly): the token rows sorted by slot and cut into tiles of at
    most GROUP_TILE rows of one slot, padded with empty tiles of slot -1 to a fixed table size."""

    order: torch.Tensor  # [num_tokens] int, token rows sorted by slot
    starts: torch.Tensor  # [num_tiles + 1] int, offsets into `order`
    slots: torch.Tensor  # [num_tiles] int, -1 = padding


LoraLayout = Segments | Tokens | Tiles  # which shrink / expand kernels run


@dataclass(frozen=True)
class LoraDelta:
    """A projection's LoRA delta left for the kernel that consumes its output to add (decode):
    y[t, lo_s + c] += scaling[slot, s] * sum_{r < rank[slot, s]} h[t, slot, s, r] * b[slot, s, c, r]
    for each token t on an adapter (slot = token_slots[t] >= 0), slice s at column offset lo_s.
    As in the worker's buffers, h and b are zero past each slot's rank (Triton sums them all)."""

    h: torch.Tensor  # [num_tokens, num_slots, num_slices, max_rank]: x A^T of slots [0, num_slots)
    weights: SlotWeights  # its b, ranks, scalings and output_sizes (A is already in h)
    token_slots: torch.Tensor  # [num_tokens] int, -1 = base


def max_tiles(num_tokens: int, max_loras: int) -> int:
    """Tiles the grouped layout needs at most: sum over slots of ceil(n_slot / GROUP_TILE)."""
    return -(-num_tokens // GROUP_TILE) + min(max_loras, num_tokens)


def group_tiles(slots: list[int], num_tiles: int) -> tuple[list[int], list[int], list[int]]:
    """Host-side grouped layout of token `slots` (-1 = base): (order [num_tokens],
    tile_starts [num_tiles + 1], tile_slots [num_tiles]), padded with empty tiles of slot -1.
    Base tokens sit at the end of `order`, outside every tile."""
    num_base = slots.count(-1)
    by_slot = sorted(range(len(slots)), key=slots.__getitem__)  # stable: base rows (-1) first
    order = by_slot[num_base:] + by_slot[:num_base]
    starts: list[int] = []
    tile_slots: list[int] = []
    for pos in range(len(order) - num_base):
        slot = slots[order[pos]]
        if not tile_slots or tile_slots[-1] != slot or pos - starts[-1] == GROUP_TILE:
            starts.append(pos)
            tile_slots.append(slot)
    end = len(order) - num_base
    if len(tile_slots) > num_tiles:
        raise ValueError(f"{len(tile_slots)} tiles do not fit a table of {num_tiles}")
    pad = num_tiles - len(tile_slots)
    return order, starts + [end] * (pad + 1), tile_slots + [-1] * pad
