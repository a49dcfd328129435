"""Torch reference multi-LoRA ops (shrink / expand), the contract for the Triton versions.

Every LoRA-able layer keeps stacked, zero-padded per-slot buffers (kernels/lora_types.SlotWeights):

    a        [max_loras, num_slices, max_rank, in_features]     lora_A of each slice
    b        [max_loras, num_slices, max_out_slice, max_rank]   lora_B of each slice
    ranks    [max_loras, num_slices] int                        real rank (0 = slice not targeted)
    scalings [max_loras, num_slices] float                      alpha / rank (or alpha / sqrt(rank))

A fused layer has several output slices (qkv: 3, gate_up: 2, others: 1); `output_sizes`
gives each slice's width, slice s writes columns [sum(output_sizes[:s]), ... + output_sizes[s]).

LoRA is two steps, `y += ((x @ A^T) @ B^T) * scaling`:

    shrink: x [num_tokens, in]               -> buf [num_slices, num_tokens, max_rank]
    expand: buf [num_slices, num_tokens, max_rank] -> added in place into y [num_tokens, sum(output_sizes)]

Three token layouts (kernels/lora_types.py):

  * Segments (prefill): tokens come as contiguous runs sharing one slot; each segment
    computes only its adapter's real rank per slice.
  * Tokens (decode): each token its own slot. Gathers each token's A/B, computing up to the
    batch's largest real rank and masking each token to its own rank.
  * Tiles (decode, CUDA-graph friendly): the tokens layout computed per adapter, over the
    token rows sorted by slot and cut into tiles of one slot (`group_tiles`). Its stacked
    expand takes the shrink of every slot, h [num_tokens, max_loras, num_slices, max_rank],
    from one GEMM over the base weight stacked with every A.

Columns of `buf` past a token's rank, and rows of tokens on the base model, are zero.
Ranks and scalings are read from the host tables of SlotWeights, so no op syncs on CUDA
when segment offsets come as CPU tensors and Tokens names its used slots.

Containment: a row computes only with its own slot's weights, and a base row (slot -1) with
none. Rows are left out by selection (`torch.where`, or computing only a segment's or tile's
own rows), never by multiplying by zero: an adapter may hold huge finite weights, and
inf * 0 is NaN. A base row's output is left as it was, bit for bit.
"""

from __future__ import annotations

import torch

from ledgerserve.kernels.lora_types import LoraDelta, Segments, SlotWeights, Tiles, Tokens


def add_lora_delta(y: torch.Tensor, delta: LoraDelta) -> torch.Tensor:
    """y + delta as a new tensor (y: [num_tokens, sum(output_sizes)]), rounded like lora_expand_tokens.
    h holds every slot's shrink of every row; a row reads only its own slot's, a base row none."""
    slots = delta.token_slots.long()
    on, idx = _on_and_index(slots)
    tokens = torch.arange(slots.shape[0], device=slots.device)
    h = delta.h[tokens, idx]  # [num_tokens, num_slices, max_rank]
    buf = torch.where(on[:, None, None], h, 0).permute(1, 0, 2)  # [num_slices, num_tokens, max_rank]
    out = y.clone()
    lora_expand_tokens(out, buf, delta.weights, Tokens(slots))
    return out


def lora_shrink_segments(
    x: torch.Tensor,  # [num_tokens, in]
    w: SlotWeights,
    segs: Segments,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices, max_rank = w.a.shape[1], w.a.shape[2]
    buf = x.new_zeros(num_slices, x.shape[0], max_rank)
    for start, end, slot in _segments(segs.starts, segs.slots):
        for s in range(num_slices):
            rank = w.rank_table[slot][s]
            if rank > 0:
                buf[s, start:end, :rank] = x[start:end] @ w.a[slot, s, :rank].T  # [seg_len, rank]
    return buf


def lora_expand_segments(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    w: SlotWeights,
    segs: Segments,
) -> None:
    for start, end, slot in _segments(segs.starts, segs.slots):
        for s, (lo, size) in enumerate(zip(_offsets(w.output_sizes), w.output_sizes)):
            rank = w.rank_table[slot][s]
            if rank > 0:
                delta = buf[s, start:end, :rank] @ w.b[slot, s, :size, :rank].T  # [seg_len, size]
                y[start:end, lo : lo + size] += delta * w.scale_table[slot][s]


def lora_shrink_tokens(
    x: torch.Tensor,  # [num_tokens, in]
    w: SlotWeights,
    tokens: Tokens,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices = w.a.shape[1]
    buf = x.new_zeros(num_slices, x.shape[0], w.a.shape[2])
    rank, token_ranks, idx, on = _token_ranks(w, tokens)
    if rank == 0:
        return buf
    a_tok = torch.where(on[:, None, None, None], w.a[idx, :, :rank], 0)  # [num_tokens, num_slices, rank, in]
    out = torch.einsum("ti,tsri->str", x, a_tok)  # [num_slices, num_tokens, rank]
    buf[:, :, :rank] = torch.where(_within_rank(token_ranks, rank), out, 0)
    return buf


def lora_expand_tokens(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    w: SlotWeights,
    tokens: Tokens,
) -> None:
    rank, token_ranks, idx, on = _token_ranks(w, tokens)
    if rank == 0:
        return
    h = torch.where(_within_rank(token_ranks, rank), buf[:, :, :rank], 0)  # [num_slices, num_tokens, rank]
    scale = torch.where(on, w.scalings[idx].T, 0)  # [num_slices, num_tokens] float32
    for s, (lo, size) in enumerate(zip(_offsets(w.output_sizes), w.output_sizes)):
        b_tok = torch.where(on[:, None, None], w.b[idx, s, :size, :rank], 0)  # [num_tokens, size, rank]
        delta = torch.einsum("tr,tor->to", h[s], b_tok)  # [num_tokens, size]
        cols = y[:, lo : lo + size]
        cols.copy_(torch.where(on[:, None], cols + delta * scale[s, :, None], cols))


def lora_shrink_grouped(
    x: torch.Tensor,  # [num_tokens, in]
    w: SlotWeights,
    tiles: Tiles,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank]
    num_slices, max_rank = w.a.shape[1], w.a.shape[2]
    buf = x.new_zeros(num_slices, x.shape[0], max_rank)
    rows_of = tiles.order.tolist()
    for start, end, slot in _segments(tiles.starts, tiles.slots):
        rows = rows_of[start:end]
        for s in range(num_slices):
            rank = w.rank_table[slot][s]
            if rank > 0:
                buf[s, rows, :rank] = x[rows] @ w.a[slot, s, :rank].T  # [tile_len, rank]
    return buf


def lora_expand_grouped(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,  # [num_slices, num_tokens, max_rank]
    w: SlotWeights,
    tiles: Tiles,
) -> None:
    every_slot = buf.permute(1, 0, 2).unsqueeze(1).expand(-1, w.b.shape[0], -1, -1)  # [num_tokens, max_loras, ...]
    lora_expand_stacked(y, every_slot, w, tiles)


def lora_expand_stacked(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    h: torch.Tensor,  # [num_tokens, max_loras, num_slices, max_rank]: x A^T of every slot
    w: SlotWeights,
    tiles: Tiles,
) -> None:
    """The grouped expand when the shrink ran for every slot at once: one GEMM against the base
    weight stacked over every slot's A gives `h` (worker_proc/models/layers.py); each tile reads
    its own slot's columns."""
    rows_of = tiles.order.tolist()
    for start, end, slot in _segments(tiles.starts, tiles.slots):
        rows = rows_of[start:end]
        for s, (lo, size) in enumerate(zip(_offsets(w.output_sizes), w.output_sizes)):
            rank = w.rank_table[slot][s]
            if rank > 0:
                delta = h[rows, slot, s, :rank] @ w.b[slot, s, :size, :rank].T  # [tile_len, size]
                y[rows, lo : lo + size] += delta * w.scale_table[slot][s]


def _segments(starts: torch.Tensor, slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """(start, end, slot) of each non-empty segment on an adapter."""
    starts_of, slots_of = starts.tolist(), slots.tolist()
    return [
        (starts_of[i], starts_of[i + 1], slot)
        for i, slot in enumerate(slots_of)
        if slot >= 0 and starts_of[i + 1] > starts_of[i]
    ]


def _offsets(output_sizes: list[int]) -> list[int]:
    offsets, total = [], 0
    for size in output_sizes:
        offsets.append(total)
        total += size
    return offsets


def _on_and_index(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each token is on an adapter [num_tokens] bool, a gather index [num_tokens] valid for
    every token). A base token's index is slot 0's: what is gathered there is always replaced by
    torch.where before any arithmetic."""
    on = slots >= 0
    return on, torch.where(on, slots, 0).long()


def _token_ranks(w: SlotWeights, tokens: Tokens) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(largest real rank in the batch, per-token ranks [num_slices, num_tokens] (0 for base tokens),
    gather index [num_tokens], on an adapter [num_tokens] bool)."""
    on, idx = _on_and_index(tokens.slots)
    token_ranks = torch.where(on, w.ranks[idx].T, 0)  # [num_slices, num_tokens]
    if tokens.used is not None:
        return w.batch_rank(tokens.used), token_ranks, idx, on
    rank = int(token_ranks.max()) if token_ranks.numel() else 0
    return rank, token_ranks, idx, on


def _within_rank(token_ranks: torch.Tensor, rank: int) -> torch.Tensor:
    """[num_slices, num_tokens, rank] bool: whether the column is within that token's rank."""
    cols = torch.arange(rank, device=token_ranks.device)
    return cols < token_ranks[..., None]
