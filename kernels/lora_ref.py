"""Torch reference multi-LoRA ops (shrink / expand), the contract for Triton versions.

Every LoRA-able layer keeps stacked, zero-padded per-slot buffers:

    a        [max_loras, num_slices, max_rank, in_features]     lora_A of each slice
    b        [max_loras, num_slices, max_out_slice, max_rank]   lora_B of each slice
    ranks    [max_loras, num_slices] int                        real rank (0 = slice not targeted)
    scalings [max_loras, num_slices] float                      alpha / rank (or alpha / sqrt(rank))

A fused layer has several output slices (qkv: 3, gate_up: 2, others: 1); `output_sizes`
gives each slice's width, slice s writes columns [sum(output_sizes[:s]), ... + output_sizes[s]).

LoRA is two steps, `y += ((x @ A^T) @ B^T) * scaling`:

    shrink: x [num_tokens, in]               -> buf [num_slices, num_tokens, max_rank]
    expand: buf [num_slices, num_tokens, max_rank] -> added in place into y [num_tokens, sum(output_sizes)]

Two token layouts:

  * segments (prefill): tokens come as contiguous runs sharing one slot;
    `seg_starts` [num_segments + 1] token offsets, `seg_slots` [num_segments] (-1 = base).
    Each segment computes only its adapter's real rank per slice.
  * tokens (decode): `token_slots` [num_tokens], each token its own slot (-1 = base).
    Gathers each token's A/B, computing up to the batch's largest real rank and masking
    each token to its own rank.

Columns of `buf` past a token's rank, and rows of tokens on the base model, are zero.

  * grouped (decode, CUDA-graph friendly): the tokens layout computed per adapter. The
    host sorts the token rows by slot into `order` [num_tokens] and cuts each slot's run
    into tiles of at most GROUP_TILE rows: `tile_starts` [num_tiles + 1] offsets into
    `order`, `tile_slots` [num_tiles]. Padding tiles are empty with slot -1, so a fixed
    `max_tiles(num_tokens, max_loras)` table serves any batch (see `group_tiles`).
    Its stacked expand takes the shrink of every slot, h [num_tokens, max_loras,
    num_slices, max_rank], from one GEMM over the base weight stacked with every A.

No host sync on CUDA when the caller passes the host-side copies it keeps: `rank_table`
(ranks as nested lists), `scale_table` (scalings likewise), segment offsets/slots as host
lists or CPU tensors, and for the token ops `max_rank` (the batch's largest real rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoraDelta:
    """A projection's LoRA delta left for the kernel that consumes its output to add (decode):
    y[t, lo_s + c] += scaling[slot, s] * sum_{r < rank[slot, s]} h[t, slot, s, r] * b[slot, s, c, r]
    for each token t on an adapter (slot = token_slots[t] >= 0), slice s at column offset lo_s.
    As in the worker's buffers, h and b are zero past each slot's rank (Triton sums them all)."""

    h: torch.Tensor  # [num_tokens, num_slots, num_slices, max_rank]: x A^T of slots [0, num_slots)
    b: torch.Tensor  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor  # [max_loras, num_slices] int
    scalings: torch.Tensor  # [max_loras, num_slices] float32
    token_slots: torch.Tensor  # [num_tokens] int, -1 = base


def add_lora_delta(y: torch.Tensor, delta: LoraDelta, output_sizes: list[int]) -> torch.Tensor:
    """y + delta as a new tensor (y: [num_tokens, sum(output_sizes)]), rounded like lora_expand_tokens."""
    slots = delta.token_slots.long()
    tokens = torch.arange(slots.shape[0], device=slots.device)
    buf = delta.h[tokens, slots.clamp(min=0)].permute(1, 0, 2)  # [num_slices, num_tokens, max_rank]
    out = y.clone()
    lora_expand_tokens(out, buf, delta.b, delta.ranks, delta.scalings, output_sizes, slots)
    return out


GROUP_TILE = 16  # rows per tile of the grouped layout (the smallest tl.dot tile)


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


def lora_shrink_segments(
    x: torch.Tensor,  # [num_tokens, in]
    a: torch.Tensor,  # [max_loras, num_slices, max_rank, in]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    seg_starts: torch.Tensor,  # [num_segments + 1] int
    seg_slots: torch.Tensor,  # [num_segments] int, -1 = base
    rank_table: list[list[int]] | None = None,  # host copy of ranks
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices, max_rank = a.shape[1], a.shape[2]
    buf = x.new_zeros(num_slices, x.shape[0], max_rank)
    rank_table = ranks.tolist() if rank_table is None else rank_table
    for start, end, slot in _segments(seg_starts, seg_slots):
        for s in range(num_slices):
            rank = rank_table[slot][s]
            if rank > 0:
                buf[s, start:end, :rank] = x[start:end] @ a[slot, s, :rank].T  # [seg_len, rank]
    return buf


def lora_expand_segments(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    b: torch.Tensor,  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    scalings: torch.Tensor,  # [max_loras, num_slices]
    output_sizes: list[int],
    seg_starts: torch.Tensor,  # [num_segments + 1] int
    seg_slots: torch.Tensor,  # [num_segments] int, -1 = base
    rank_table: list[list[int]] | None = None,  # host copy of ranks
    scale_table: list[list[float]] | None = None,  # host copy of scalings
) -> None:
    rank_table = ranks.tolist() if rank_table is None else rank_table
    scale_table = scalings.tolist() if scale_table is None else scale_table
    offsets = _offsets(output_sizes)
    for start, end, slot in _segments(seg_starts, seg_slots):
        for s, (lo, size) in enumerate(zip(offsets, output_sizes)):
            rank = rank_table[slot][s]
            if rank > 0:
                delta = buf[s, start:end, :rank] @ b[slot, s, :size, :rank].T  # [seg_len, size]
                y[start:end, lo : lo + size] += delta * scale_table[slot][s]


def lora_shrink_tokens(
    x: torch.Tensor,  # [num_tokens, in]
    a: torch.Tensor,  # [max_loras, num_slices, max_rank, in]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    token_slots: torch.Tensor,  # [num_tokens] int, -1 = base
    max_rank: int | None = None,  # the batch's largest real rank, if the caller knows it
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices = a.shape[1]
    buf = x.new_zeros(num_slices, x.shape[0], a.shape[2])
    rank, token_ranks, idx = _token_ranks(ranks, token_slots, max_rank)
    if rank == 0:
        return buf
    a_tok = a[idx, :, :rank]  # [num_tokens, num_slices, rank, in]
    out = torch.einsum("ti,tsri->str", x, a_tok)  # [num_slices, num_tokens, rank]
    buf[:, :, :rank] = out * _rank_mask(token_ranks, rank, x.dtype)
    return buf


def lora_expand_tokens(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    b: torch.Tensor,  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    scalings: torch.Tensor,  # [max_loras, num_slices]
    output_sizes: list[int],
    token_slots: torch.Tensor,  # [num_tokens] int, -1 = base
    max_rank: int | None = None,  # the batch's largest real rank, if the caller knows it
) -> None:
    rank, token_ranks, idx = _token_ranks(ranks, token_slots, max_rank)
    if rank == 0:
        return
    h = buf[:, :, :rank] * _rank_mask(token_ranks, rank, buf.dtype)  # [num_slices, num_tokens, rank]
    on = (token_slots >= 0).to(y.dtype)  # [num_tokens]
    scale = scalings[idx].T * on  # [num_slices, num_tokens]
    for s, (lo, size) in enumerate(zip(_offsets(output_sizes), output_sizes)):
        b_tok = b[idx, s, :size, :rank]  # [num_tokens, size, rank]
        delta = torch.einsum("tr,tor->to", h[s], b_tok)  # [num_tokens, size]
        y[:, lo : lo + size] += delta * scale[s, :, None]


def lora_shrink_grouped(
    x: torch.Tensor,  # [num_tokens, in]
    a: torch.Tensor,  # [max_loras, num_slices, max_rank, in]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    order: torch.Tensor,  # [num_tokens] int, token rows sorted by slot
    tile_starts: torch.Tensor,  # [num_tiles + 1] int, offsets into order
    tile_slots: torch.Tensor,  # [num_tiles] int, -1 = padding
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices, max_rank = a.shape[1], a.shape[2]
    buf = x.new_zeros(num_slices, x.shape[0], max_rank)
    rank_table, rows_of = ranks.tolist(), order.tolist()
    for start, end, slot in _segments(tile_starts, tile_slots):
        rows = rows_of[start:end]
        for s in range(num_slices):
            rank = rank_table[slot][s]
            if rank > 0:
                buf[s, rows, :rank] = x[rows] @ a[slot, s, :rank].T  # [tile_len, rank]
    return buf


def lora_expand_grouped(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    b: torch.Tensor,  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    scalings: torch.Tensor,  # [max_loras, num_slices]
    output_sizes: list[int],
    order: torch.Tensor,  # [num_tokens] int
    tile_starts: torch.Tensor,  # [num_tiles + 1] int
    tile_slots: torch.Tensor,  # [num_tiles] int
) -> None:
    every_slot = buf.permute(1, 0, 2).unsqueeze(1).expand(-1, b.shape[0], -1, -1)  # [num_tokens, max_loras, ...]
    lora_expand_stacked(y, every_slot, b, ranks, scalings, output_sizes, order, tile_starts, tile_slots)


def lora_expand_stacked(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    h: torch.Tensor,  # [num_tokens, max_loras, num_slices, max_rank]: x A^T of every slot
    b: torch.Tensor,  # [max_loras, num_slices, max_out_slice, max_rank]
    ranks: torch.Tensor,  # [max_loras, num_slices] int
    scalings: torch.Tensor,  # [max_loras, num_slices]
    output_sizes: list[int],
    order: torch.Tensor,  # [num_tokens] int
    tile_starts: torch.Tensor,  # [num_tiles + 1] int
    tile_slots: torch.Tensor,  # [num_tiles] int
) -> None:
    """The grouped expand when the shrink ran for every slot at once: one GEMM against the base
    weight stacked over every slot's A gives `h` (worker_proc/models/layers.py); each tile reads
    its own slot's columns."""
    rank_table, scale_table, rows_of = ranks.tolist(), scalings.tolist(), order.tolist()
    for start, end, slot in _segments(tile_starts, tile_slots):
        rows = rows_of[start:end]
        for s, (lo, size) in enumerate(zip(_offsets(output_sizes), output_sizes)):
            rank = rank_table[slot][s]
            if rank > 0:
                delta = h[rows, slot, s, :rank] @ b[slot, s, :size, :rank].T  # [tile_len, size]
                y[rows, lo : lo + size] += delta * scale_table[slot][s]


def _segments(seg_starts: torch.Tensor | list[int], seg_slots: torch.Tensor | list[int]) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each non-empty segment on an adapter."""
    starts = seg_starts.tolist() if isinstance(seg_starts, torch.Tensor) else seg_starts
    slots = seg_slots.tolist() if isinstance(seg_slots, torch.Tensor) else seg_slots
    return [(starts[i], starts[i + 1], slot) for i, slot in enumerate(slots) if slot >= 0 and starts[i + 1] > starts[i]]


def _offsets(output_sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in output_sizes:
        offsets.append(total)
        total += size
    return offsets


def _token_ranks(
    ranks: torch.Tensor, token_slots: torch.Tensor, max_rank: int | None
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(largest real rank in the batch, per-token ranks [num_slices, num_tokens], gather index)."""
    on = token_slots >= 0  # [num_tokens]
    idx = token_slots.clamp(min=0).long()  # [num_tokens]
    token_ranks = ranks[idx].T * on  # [num_slices, num_tokens]
    if max_rank is not None:
        return max_rank, token_ranks, idx
    rank = int(token_ranks.max()) if token_ranks.numel() else 0
    return rank, token_ranks, idx


def _rank_mask(token_ranks: torch.Tensor, rank: int, dtype: torch.dtype) -> torch.Tensor:
    """[num_slices, num_tokens, rank]: 1 where the column is within that token's rank."""
    cols = torch.arange(rank, device=token_ranks.device)
    return (cols < token_ranks[..., None]).to(dtype)
