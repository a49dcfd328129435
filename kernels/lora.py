"""Triton multi-LoRA shrink / expand: the contract of kernels/lora_ref.py, taking the same
structs (kernels/lora_types.py).

One pair of kernels serves both token layouts. Shrink splits the input dimension over
programs and adds float32 partials atomically into a float32 `buf` (so `buf` is float32
here); expand rounds it to the weights' dtype where the reference does. A program owns one (segment, slice,
row block) for shrink, one (segment, slice, column block, row block) for expand; in the
per-token layout a "segment" is one token and its slot comes from `token_slots`. Each
program reads its slot's real rank from `ranks` and loads only those rows of A / columns
of B (masked loads), so the bytes read follow each adapter's real rank; slots -1 and
rank-0 slices exit at once, having loaded nothing of any slot. A program computes only its own
segment's or tile's rows, which share one slot; rows past its end (a ragged tile, the per-token
layout's one row of BLOCK_M_TOK) are loaded as zeros, may hold NaN in registers (zero times an
infinite value) and are never stored, so no adapter's output reaches another row. No host sync:
grid sizes come from shapes and host ints (a Segments without `max_len` is the exception: its
longest run is read back).
The grouped layout (decode) is the segment layout over `order`, the batch's token rows
sorted by slot and cut into tiles of at most GROUP_TILE rows: each program gathers its
rows through `order` (GATHER), so each distinct adapter's A / B are read once per tile.
Its stacked expand reads the shrink of every slot out of one GEMM over the base weight
stacked with every A (worker_proc/models/layers.py), so decode runs no shrink kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.lora_types import GROUP_TILE, Segments, SlotWeights, Tiles, Tokens
from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous

BLOCK_M_SEG = 32  # rows per program in the segment layout
BLOCK_M_TOK = 16  # the smallest tl.dot tile; one valid row per program in the token layout
K_PER_SPLIT = 1024  # shrink splits the input dim so a GEMV of a few rows still fills the chip
EXPAND_BLOCK_N = 256  # output columns per expand program (swept 64..512 at batch 32 on an H200, out-major B)


@triton.jit
def _rows(idx_ptr, pos, pos_mask, GATHER: tl.constexpr):
    """Token rows of positions `pos`: through the grouped layout's `order` if GATHER."""
    if GATHER:
        return tl.load(idx_ptr + pos, mask=pos_mask, other=0).to(tl.int64)
    return pos


@triton.jit
def _segment(seg_starts_ptr, seg_slots_ptr, seg, PER_TOKEN: tl.constexpr):
    slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
    if PER_TOKEN:
        start = seg.to(tl.int64)
        end = start + 1
    else:
        start = tl.load(seg_starts_ptr + seg).to(tl.int64)
        end = tl.load(seg_starts_ptr + seg + 1).to(tl.int64)
    return start, end, slot


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, ranks_ptr, buf_ptr, seg_starts_ptr, seg_slots_ptr, idx_ptr,
    in_features, num_slices, stride_xt, stride_al, stride_as, stride_ar, stride_bufs, stride_buft, split_k,
    PER_TOKEN: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    seg, s, pid2 = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    mblk, ks = pid2 // split_k, pid2 % split_k
    start, end, slot = _segment(seg_starts_ptr, seg_slots_ptr, seg, PER_TOKEN)
    start += mblk * BLOCK_M
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * num_slices + s, mask=slot >= 0, other=0)  # base: 0
    if (slot >= 0) & (start < end) & (rank > 0):
        pos = start + tl.arange(0, BLOCK_M)  # [BLOCK_M]
        row_mask = pos < end
        rows = _rows(idx_ptr, pos, row_mask, GATHER)
        r = tl.arange(0, BLOCK_R)
        r_mask = r < rank
        a_base = a_ptr + slot * stride_al + s * stride_as
        acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
        for k0 in range(ks * K_PER_SPLIT, (ks + 1) * K_PER_SPLIT, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_mask = k < in_features
            xt = tl.load(
                x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :],
                mask=row_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_M, BLOCK_K]
            at = tl.load(
                a_base + r[None, :] * stride_ar + k[:, None], mask=r_mask[None, :] & k_mask[:, None], other=0.0
            )  # [BLOCK_K, BLOCK_R]
            acc += tl.dot(xt, at)
        out = buf_ptr + s * stride_bufs + rows[:, None].to(tl.int64) * stride_buft + r[None, :]
        tl.atomic_add(out, acc, mask=row_mask[:, None] & r_mask[None, :], sem="relaxed")  # split-K partial sums


@triton.jit
def _expand_kernel(
    y_ptr, buf_ptr, b_ptr, ranks_ptr, scalings_ptr, seg_starts_ptr, seg_slots_ptr, idx_ptr,
    size0, size1, size2, num_slices, n_blocks,
    stride_yt, stride_bufl, stride_bufs, stride_buft, stride_bl, stride_bs, stride_bo, stride_br,
    PER_TOKEN: tl.constexpr, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    seg, pid1, mblk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    s, nblk = pid1 // n_blocks, pid1 % n_blocks
    # Before the PDL wait, what no kernel of the step writes: the step's tile table and token order,
    # the slot's rank, scaling and B tile. y and the shrink come from the kernels before.
    start, end, slot = _segment(seg_starts_ptr, seg_slots_ptr, seg, PER_TOKEN)
    start += mblk * BLOCK_M
    rank = tl.load(ranks_ptr + tl.maximum(slot, 0) * num_slices + s, mask=slot >= 0, other=0)  # base: 0
    size = tl.where(s == 0, size0, tl.where(s == 1, size1, size2))
    lo = tl.where(s == 0, 0, tl.where(s == 1, size0, size0 + size1))
    active = (slot >= 0) & (start < end) & (rank > 0) & (nblk * BLOCK_N < size)
    pos = start + tl.arange(0, BLOCK_M)
    row_mask = pos < tl.where(active, end, start)  # an inactive program loads no row and no rank of B
    rows = _rows(idx_ptr, pos, row_mask, GATHER)
    r = tl.arange(0, BLOCK_R)
    r_mask = r < tl.where(active, rank, 0)
    n = nblk * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < size
    slot = tl.maximum(slot, 0)
    bt = tl.load(
        b_ptr + slot * stride_bl + s * stride_bs + n[None, :] * stride_bo + r[:, None] * stride_br,
        mask=r_mask[:, None] & n_mask[None, :],
        other=0.0,
    )  # [BLOCK_R, BLOCK_N]
    scale = tl.load(scalings_ptr + slot * num_slices + s, mask=active, other=0.0)
    wait_for_previous(PDL)
    if active:
        h_base = buf_ptr + slot * stride_bufl + s * stride_bufs  # stride_bufl: 0 unless h holds every slot
        h = tl.load(
            h_base + rows[:, None].to(tl.int64) * stride_buft + r[None, :],
            mask=row_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(b_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_R]
        delta = tl.dot(h, bt) * scale  # [BLOCK_M, BLOCK_N] float32
        mask = row_mask[:, None] & n_mask[None, :]
        out = y_ptr + rows[:, None].to(tl.int64) * stride_yt + lo + n[None, :]
        y = tl.load(out, mask=mask, other=0.0)
        tl.store(out, (y.to(tl.float32) + delta).to(y_ptr.dtype.element_ty), mask=mask)


def _shrink(
    x: torch.Tensor,  # [num_tokens, in]
    w: SlotWeights,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    m_blocks: int,
    per_token: bool,
    block_m: int,
    order: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_slices, num_tokens, max_rank] float32
    a, ranks = w.a, w.ranks
    num_segs, (num_slices, max_rank, in_features) = seg_slots.shape[0], a.shape[1:]
    assert x.stride(-1) == 1 and a.is_contiguous() and ranks.is_contiguous()
    buf = torch.zeros(num_slices, x.shape[0], max_rank, dtype=torch.float32, device=x.device)  # atomics: fp32
    if num_segs == 0 or x.shape[0] == 0:
        return buf
    block_r = max(16, triton.next_power_of_2(max_rank))
    split_k = triton.cdiv(in_features, K_PER_SPLIT)
    _shrink_kernel[(num_segs, num_slices, m_blocks * split_k)](
        x, a, ranks, buf, seg_starts, seg_slots, seg_slots if order is None else order, in_features, num_slices,
        x.stride(0), a.stride(0), a.stride(1),
        a.stride(2), buf.stride(0), buf.stride(1), split_k,
        PER_TOKEN=per_token, GATHER=order is not None, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=128,
        K_PER_SPLIT=K_PER_SPLIT,
    )  # fmt: skip
    return buf


def _per_slice_strides(buf: torch.Tensor) -> tuple[int, int, int]:
    """(slot, slice, token) strides of a shrink output buf [num_slices, num_tokens, max_rank]."""
    assert buf.stride(-1) == 1
    return 0, buf.stride(0), buf.stride(1)


def _expand(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place
    buf: torch.Tensor,
    buf_strides: tuple[int, int, int],
    w: SlotWeights,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
    m_blocks: int,
    per_token: bool,
    block_m: int,
    order: torch.Tensor | None = None,
    block_n: int = EXPAND_BLOCK_N,
    num_warps: int = 4,
) -> None:
    """buf_strides: (slot, slice, token) strides of the shrink output; rank is its unit-stride dim."""
    b, output_sizes, num_segs = w.b, w.output_sizes, seg_slots.shape[0]
    num_slices, max_rank = b.shape[1], b.shape[3]
    assert len(output_sizes) == num_slices <= 3 and y.stride(-1) == 1
    if num_segs == 0 or y.shape[0] == 0:
        return
    sizes = list(output_sizes) + [0] * (3 - num_slices)
    n_blocks = triton.cdiv(max(output_sizes), block_n)
    block_r = max(16, triton.next_power_of_2(max_rank))
    pdl = pdl_enabled(y.device)
    _expand_kernel[(num_segs, num_slices * n_blocks, m_blocks)](
        y, buf, b, w.ranks, w.scalings, seg_starts, seg_slots, seg_slots if order is None else order,
        sizes[0], sizes[1], sizes[2], num_slices, n_blocks,
        y.stride(0), *buf_strides, b.stride(0), b.stride(1), b.stride(2), b.stride(3),
        PER_TOKEN=per_token, GATHER=order is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
        PDL=pdl, num_warps=num_warps, launch_pdl=pdl,
    )  # fmt: skip


def _segment_blocks(segs: Segments) -> int:
    """Row blocks of the longest segment (read from its offsets, a sync, if the caller did not say)."""
    max_len = int((segs.starts[1:] - segs.starts[:-1]).max()) if segs.max_len is None else segs.max_len
    return triton.cdiv(max(max_len, 1), BLOCK_M_SEG)


def lora_shrink_segments(x: torch.Tensor, w: SlotWeights, segs: Segments) -> torch.Tensor:
    """x [num_tokens, in] -> [num_slices, num_tokens, max_rank]; segs on x's device."""
    return _shrink(x, w, segs.starts, segs.slots, _segment_blocks(segs), False, BLOCK_M_SEG)


def lora_expand_segments(y: torch.Tensor, buf: torch.Tensor, w: SlotWeights, segs: Segments) -> None:
    _expand(y, buf, _per_slice_strides(buf), w, segs.starts, segs.slots, _segment_blocks(segs), False, BLOCK_M_SEG)


def lora_shrink_tokens(x: torch.Tensor, w: SlotWeights, tokens: Tokens) -> torch.Tensor:
    """Each program reads its own token's rank: `tokens.used` is not needed."""
    return _shrink(x, w, tokens.slots, tokens.slots, 1, True, BLOCK_M_TOK)


def lora_expand_tokens(y: torch.Tensor, buf: torch.Tensor, w: SlotWeights, tokens: Tokens) -> None:
    _expand(y, buf, _per_slice_strides(buf), w, tokens.slots, tokens.slots, 1, True, BLOCK_M_TOK)


def lora_shrink_grouped(x: torch.Tensor, w: SlotWeights, tiles: Tiles) -> torch.Tensor:
    return _shrink(x, w, tiles.starts, tiles.slots, 1, False, GROUP_TILE, tiles.order)


def lora_expand_grouped(y: torch.Tensor, buf: torch.Tensor, w: SlotWeights, tiles: Tiles) -> None:
    _expand(y, buf, _per_slice_strides(buf), w, tiles.starts, tiles.slots, 1, False, GROUP_TILE, tiles.order)


def lora_expand_stacked(
    y: torch.Tensor,  # [num_tokens, sum(output_sizes)], updated in place (rows may be strided)
    h: torch.Tensor,  # [num_tokens, max_loras, num_slices, max_rank]: x A^T of every slot, rank unit-stride
    w: SlotWeights,
    tiles: Tiles,
    block_n: int = EXPAND_BLOCK_N,
    num_warps: int = 4,
) -> None:
    assert h.stride(-1) == 1
    strides = (h.stride(1), h.stride(2), h.stride(0))
    _expand(y, h, strides, w, tiles.starts, tiles.slots, 1, False, GROUP_TILE, tiles.order, block_n, num_warps)
