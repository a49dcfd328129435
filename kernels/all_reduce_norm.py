"""Triton: a one-shot all-reduce over symmetric memory fused into the residual-add RMSNorm that
consumes it (tensor parallel, decode-sized batches).

A row-parallel projection (o, down) leaves every rank a partial sum of its output and, under
stacked LoRA, of its shrink h. Instead of an all-reduce kernel and then kernels/fused.py's norm,
one program per row: stores this rank's partial row (and the row's slice of h for its slot) in
this rank's buffer, meets the other ranks' programs for the same row at a barrier, sums the row
over every rank's buffer through the peers' mappings (in rank order, so every rank holds the same
sum), and goes on as the residual-add RMSNorm does: LoRA delta, residual, norm. One launch instead
of two, and the norm weight and the slot's B load before the projection has finished (PDL).

The buffer has two halves and consecutive calls take different ones (the caller names the half):
a rank writes a half again only after passing the next call's barrier, which every other rank
reaches only once it is done reading that half, so nothing waits after the reads.

The barrier, per row, on the signal pads (zero-filled): raise this rank's flag at every peer (CAS
0 -> 1, release, system scope; it spins while the peer has not yet taken the previous raise), then
take every peer's flag here (CAS 1 -> 0, acquire). When every rank has passed, every flag is zero
again, so a CUDA graph replays the kernel as captured.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.fused import PREFETCH_B_ELEMS, add_residual_and_norm
from ledgerserve.kernels.lora_delta import delta_args, lora_b_tile, rank_pad, token_slot
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous
from ledgerserve.kernels.peer_buffers import PeerBuffers


def row_len(hidden: int, delta: LoraDelta | None) -> int:
    """Elements one row takes in a half: the padded hidden row, then the slot's padded h."""
    return triton.next_power_of_2(hidden) + rank_pad(delta)


def fits(peers: PeerBuffers, x: torch.Tensor, delta: LoraDelta | None) -> bool:
    """Whether the fused kernel takes x [num_tokens, hidden] (+ delta): dtype, rows, and a B tile
    small enough to hold in registers."""
    block, r_pad = triton.next_power_of_2(x.shape[-1]), rank_pad(delta)
    return (
        x.dtype == peers.dtype
        and x.stride(-1) == 1
        and x.shape[0] <= peers.max_rows
        and x.shape[0] * row_len(x.shape[-1], delta) <= peers.half_numel
        and r_pad * block <= PREFETCH_B_ELEMS
        and (delta is None or delta.h.shape[2] == 1)
    )


@triton.jit
def _rank_row(table_ptr, rank, offset, ELEM: tl.constexpr):
    """Pointer to element `offset` of rank `rank`'s buffer, whose address is table_ptr[rank]."""
    return tl.load(table_ptr + rank).to(tl.pointer_type(ELEM)) + offset


@triton.jit
def _row_barrier(pad_table_ptr, row, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Return once every rank's program for `row` has arrived; what they stored before arriving is
    then visible here (see the module's docstring)."""
    tl.debug_barrier()  # every thread's stores before this rank's raise
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = _rank_row(pad_table_ptr, peer, row * WORLD + RANK, tl.int32)
            while tl.atomic_cas(flag, 0, 1, sem="release", scope="sys") != 0:
                pass
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            flag = _rank_row(pad_table_ptr, RANK, row * WORLD + peer, tl.int32)
            while tl.atomic_cas(flag, 1, 0, sem="acquire", scope="sys") != 1:
                pass
    tl.debug_barrier()  # every thread reads after the takes


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_table_ptr, pad_table_ptr,
    stride_x, stride_res, stride_out, stride_res_out, half_offset,
    n_cols, eps,
    h_ptr, b_ptr, scalings_ptr, lora_slots_ptr, max_rank, stride_ht, stride_hl, stride_hs,
    stride_bl, stride_bs, stride_bo, stride_br,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    at = half_offset + row * (BLOCK + R_PAD)  # this row's place in every rank's half
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if R_PAD > 0:  # B before the wait: its latency hides behind the projection
        lora_slot = tl.load(lora_slots_ptr + row)  # the step's input row: written before the graph ran
        bt, scale = lora_b_tile(
            b_ptr, scalings_ptr, lora_slot, 0, 1, max_rank, cols, mask, stride_bl, stride_bs, stride_bo, stride_br,
            R_PAD,
        )  # fmt: skip
        slot, rank_on = token_slot(lora_slot, max_rank)
        r = tl.arange(0, R_PAD)
    wait_for_previous(PDL)  # x and h come from the projection
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    own = _rank_row(buf_table_ptr, RANK, at, x.dtype)
    tl.store(own + cols, x, mask=mask)
    if R_PAD > 0:  # slice 0 of the slot's h: this rank's partial shrink
        hv = tl.load(h_ptr + row * stride_ht + slot * stride_hl + r, mask=r < rank_on, other=0.0)
        tl.store(own + BLOCK + r, hv)
    _row_barrier(pad_table_ptr, row, RANK, WORLD)
    acc = tl.zeros([BLOCK], tl.float32)
    if R_PAD > 0:
        h_acc = tl.zeros([R_PAD], tl.float32)
    # rank order: every rank sums alike; .cg reads past L1, which keeps no copy of a peer's half
    for peer in tl.static_range(WORLD):
        src = _rank_row(buf_table_ptr, peer, at, x.dtype)
        acc += tl.load(src + cols, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        if R_PAD > 0:
            h_acc += tl.load(src + BLOCK + r, cache_modifier=".cg").to(tl.float32)
    x = acc.to(x.dtype)  # rounded like the all-reduce's output
    if R_PAD > 0:
        h_sum = h_acc.to(x.dtype).to(tl.float32)  # rounded like the all-reduced h
        d = tl.sum(h_sum[:, None] * bt.to(tl.float32), axis=0) * scale
        x = (x.to(tl.float32) + d).to(x.dtype)
    add_residual_and_norm(
        x, w, row, cols, mask, n_cols, eps, res_ptr, res_out_ptr, out_ptr, stride_res, stride_res_out, stride_out,
        True,
    )  # fmt: skip


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]: this rank's partial sum (rows may be strided)
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    delta: LoraDelta | None,  # x's pending LoRA delta, its h this rank's partial shrink
    peers: PeerBuffers,
    half: int,  # 0 or 1: which half of the buffer (consecutive calls alternate)
) -> tuple[torch.Tensor, torch.Tensor]:
    """normed, new_residual = x summed over the ranks (+ its LoRA delta) + residual, as
    kernels/fused.fused_add_rms_norm after an all-reduce of x and h. Every rank calls it with the
    same shapes; `fits` must hold."""
    assert fits(peers, x, delta) and x.shape == residual.shape and residual.stride(-1) == 1
    num_tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        block, r_pad, pdl = triton.next_power_of_2(hidden), rank_pad(delta), pdl_enabled(x.device)
        _all_reduce_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, res_out, peers.buffer_ptrs, peers.signal_pad_ptrs,
            x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), half * peers.half_numel,
            hidden, eps, *delta_args(delta, x),
            RANK=peers.rank, WORLD=peers.world_size, BLOCK=block, R_PAD=r_pad, PDL=pdl,
            num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
        )  # fmt: skip
    return out, res_out
