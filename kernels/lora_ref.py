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

No host sync on CUDA when the caller passes the host-side copies it keeps: `rank_table`
(ranks as nested lists), `scale_table` (scalings likewise), segment offsets/slots as host
lists or CPU tensors, and for the token ops `max_rank` (the batch's largest real rank).
"""

from __future__ import annotations

import torch


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
