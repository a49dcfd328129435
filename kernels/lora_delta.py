"""Triton helpers that add a projection's pending LoRA delta (kernels/lora_types.LoraDelta)
inside the kernel that consumes its output (kernels/fused.py: the residual-add RMSNorm after
o / down, SiLU-and-mul after gate_up), so those projections launch no expand of their own.

A base token (slot -1) loads nothing of any slot: its h, B and scaling loads are all masked off,
and its delta is selected to zero, never multiplied by it (an adapter's weights may be huge, and
inf * 0 is NaN)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.lora_types import LoraDelta, SlotWeights

R_CHUNK = tl.constexpr(4)  # rank rows of B loaded at a time by lora_row_delta


@triton.jit
def token_slot(slot, max_rank):
    """A token's slot clamped to a valid index (int64) and the ranks it reads: max_rank, or 0 for
    a base token (slot -1). Masks take `r < rank_on`, not `slot >= 0 & ...`: Triton's interpreter
    turns a scalar bool & a vector into int64, which it then refuses as a mask."""
    return tl.maximum(slot, 0).to(tl.int64), tl.where(slot >= 0, max_rank, 0)


@triton.jit
def lora_row_delta(
    h_row_ptr, b_ptr, scalings_ptr, slot, s, num_slices, max_rank, cols, col_mask,
    stride_hl, stride_hs, stride_bl, stride_bs, stride_bo, stride_br,
    BLOCK: tl.constexpr, R_PAD: tl.constexpr,
):  # fmt: skip
    """One token's delta on columns `cols` [BLOCK] of slice s, float32; zeros when slot < 0.
    It reads all max_rank columns of h / rows of B, not the slot's rank: past its rank A and B
    are zero (LoraWeights keeps them so), and not loading the rank first saves a round trip."""
    slot, rank_on = token_slot(slot, max_rank)
    scale = tl.load(scalings_ptr + slot * num_slices + s, mask=rank_on > 0, other=0.0)
    h_base = h_row_ptr + slot * stride_hl + s * stride_hs
    b_base = b_ptr + slot * stride_bl + s * stride_bs
    acc = tl.zeros([BLOCK], tl.float32)
    for r0 in tl.static_range(0, R_PAD, R_CHUNK):
        r = r0 + tl.arange(0, R_CHUNK)
        r_mask = r < rank_on
        hv = tl.load(h_base + r, mask=r_mask, other=0.0).to(tl.float32)  # [R_CHUNK]
        bt = tl.load(
            b_base + r[:, None] * stride_br + cols[None, :] * stride_bo,
            mask=r_mask[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)  # [R_CHUNK, BLOCK]
        acc += tl.sum(hv[:, None] * bt, axis=0)
    return tl.where(rank_on > 0, acc * scale, 0.0)


@triton.jit
def lora_b_tile(
    b_ptr, scalings_ptr, slot, s, num_slices, max_rank, cols, col_mask,
    stride_bl, stride_bs, stride_bo, stride_br, R_PAD: tl.constexpr,
):  # fmt: skip
    """Slice s of the B of one token's slot on columns `cols` [BLOCK]: [R_PAD, BLOCK] (zeros when
    slot < 0 or past max_rank) and its scaling. Weights only, so a PDL kernel may load it before
    gdc_wait; lora_tile_delta finishes the delta once h may be read."""
    slot, rank_on = token_slot(slot, max_rank)
    r = tl.arange(0, R_PAD)
    bt = tl.load(
        b_ptr + slot * stride_bl + s * stride_bs + r[:, None] * stride_br + cols[None, :] * stride_bo,
        mask=(r < rank_on)[:, None] & col_mask[None, :],
        other=0.0,
    )  # [R_PAD, BLOCK]
    return bt, tl.load(scalings_ptr + slot * num_slices + s, mask=rank_on > 0, other=0.0)


@triton.jit
def lora_tile_delta(h_row_ptr, slot, s, max_rank, bt, scale, stride_hl, stride_hs, R_PAD: tl.constexpr):
    """One token's delta [BLOCK] float32 from its shrink row h and a B tile from lora_b_tile."""
    slot, rank_on = token_slot(slot, max_rank)
    r = tl.arange(0, R_PAD)
    hv = tl.load(h_row_ptr + slot * stride_hl + s * stride_hs + r, mask=r < rank_on, other=0.0)
    return tl.where(rank_on > 0, tl.sum(hv.to(tl.float32)[:, None] * bt.to(tl.float32), axis=0) * scale, 0.0)


def delta_args(delta: LoraDelta | None, dummy: torch.Tensor) -> list:
    """lora_row_delta's tensors and sizes, as a kernel's trailing arguments: h, b, scalings,
    token_slots, max_rank, then the strides of h (token, slot, slice) and b (4)."""
    if delta is None:
        return [dummy] * 4 + [0] * 8
    h, b, scalings = delta.h, delta.weights.b, delta.weights.scalings
    assert h.stride(-1) == 1 and scalings.is_contiguous()
    return [h, b, scalings, delta.token_slots, b.shape[3], h.stride(0), h.stride(1), h.stride(2), *b.stride()]


def rank_pad(delta: LoraDelta | None) -> int:
    return 0 if delta is None else weights_rank_pad(delta.weights)


def weights_rank_pad(weights: SlotWeights) -> int:
    """rank_pad of any delta over these slot weights: their max rank, padded."""
    return max(R_CHUNK.value, triton.next_power_of_2(weights.b.shape[3]))
