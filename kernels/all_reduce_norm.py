"""Triton: a one-shot all-reduce over symmetric memory fused into the residual-add RMSNorm that
consumes it (tensor parallel, decode-sized batches).

A row-parallel projection (o, down) leaves every rank a partial sum of its output and, under
stacked LoRA, of its shrink h. Instead of an all-reduce kernel and then kernels/fused.py's norm,
one program per row: sends this rank's partial row (and the row's slice of h for its slot) into
every other rank's buffer, waits for theirs in its own, sums the row over the ranks in rank order
(so every rank holds the same sum), and goes on as the residual-add RMSNorm does: LoRA delta,
residual, norm. One launch instead of two, and the norm weight and the slot's B load before the
projection has finished (PDL). Without a residual (the step's first norm, of the vocabulary-parallel
embedding's rows) the sum itself is stored as the new residual.

The rows travel as packets, NCCL's low-latency protocol: each 8-byte store carries two 16-bit
values and an epoch, so a packet is valid exactly when its epoch is the one expected, with no flag
or barrier beside the data and one one-way trip over NVLink. Each (part, row) keeps its epoch on
every rank (`PeerBuffers.epochs`, one more per call); the ranks make the same calls, so their
epochs agree. The buffer has parts, and consecutive calls take different ones (the caller names
the part): a rank sends into a part again only after the call between, which it finishes only
once every peer has sent it that call's rows, that is once every peer is done reading the part.
Nothing is ever reset, so a CUDA graph replays the kernel as captured.

A packet found in the place of a row's packets from a rank was sent for that row, so its epoch is at
most the one the row last used, never the one awaited. For this a part's layout depends on the
hidden size only: the rows from the start of the part, their h (under LoRA) in an area of its own
at its end, so calls with and without adapters put each row in the same place. The start-up
trial's rows (hidden 64) are laid out otherwise, so the worker clears its packets and epochs on
every rank before any rank makes the model's first call (worker_proc/parallel.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.fused import PREFETCH_B_ELEMS, add_residual_and_norm
from ledgerserve.kernels.lora_delta import delta_args, lora_b_tile, rank_pad, token_slot
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.kernels.packets import send, sum_ranks
from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous
from ledgerserve.kernels.peer_buffers import PeerBuffers, RowSend

H_AREA_FRACTION = 16  # the last 1/16 of a part holds h: at hidden 4096, for as many rows as the rest, up to rank 256


def h_area(part_numel: int) -> int:
    """Where the h packets start in a part; the rows' packets fill what comes before."""
    return part_numel - part_numel // H_AREA_FRACTION


def fits_part(peers: PeerBuffers, num_rows: int, hidden: int, r_pad: int) -> bool:
    """Whether num_rows rows from every rank fit a part: their rows before h_area, their h after."""
    rows = num_rows * peers.world_size
    start = h_area(peers.part_numel)
    return rows * triton.next_power_of_2(hidden) // 2 <= start and rows * r_pad // 2 <= peers.part_numel - start


def fits(peers: PeerBuffers, x: torch.Tensor, delta: LoraDelta | None) -> bool:
    """Whether the fused kernel takes x [num_tokens, hidden] (+ delta): dtype, rows, and a B tile
    small enough to hold in registers."""
    num_slices = 1 if delta is None else delta.h.shape[2]
    return x.stride(-1) == 1 and takes(peers, x.shape[0], x.shape[-1], x.dtype, rank_pad(delta), num_slices)


def takes(peers: PeerBuffers, num_rows: int, hidden: int, dtype: torch.dtype, r_pad: int, num_slices: int) -> bool:
    """fits, from the shapes alone (r_pad: the delta's padded rank, 0 without one): what a projection
    asks before its GEMV sends the row that the kernel will consume (RowSend)."""
    return (
        dtype == peers.dtype
        and dtype.itemsize == 2
        and num_rows <= peers.max_rows
        and fits_part(peers, num_rows, hidden, r_pad)
        and r_pad * triton.next_power_of_2(hidden) <= PREFETCH_B_ELEMS
        and num_slices == 1
    )


def row_send_at(send: RowSend) -> int:
    """The packet offset, in every buffer, of row 0 from this rank in the send's part."""
    peers = send.peers
    return send.part * peers.part_numel + peers.rank * triton.next_power_of_2(send.num_cols) // 2


def sends_whole_row(hidden: int, block_n: int) -> bool:
    """Whether a GEMV of block_n-column programs writes every packet of a row's place: the place holds
    next_power_of_2(hidden) values, and the kernel awaits all of them, padding included."""
    return hidden == triton.next_power_of_2(hidden) and hidden % block_n == 0 and block_n % 2 == 0


@triton.jit
def _all_reduce_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_table_ptr, epochs_ptr,
    stride_x, stride_res, stride_out, stride_res_out, part, part_numel, h_start, max_rows,
    n_cols, eps,
    h_ptr, b_ptr, scalings_ptr, lora_slots_ptr, max_rank, stride_ht, stride_hl, stride_hs,
    stride_bl, stride_bs, stride_bo, stride_br,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    X_SENT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    P: tl.constexpr = BLOCK // 2  # packets of the hidden row
    PH: tl.constexpr = R_PAD // 2  # packets of h
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
    epoch_at = epochs_ptr + part * max_rows + row
    epoch = tl.load(epoch_at) + 1
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if R_PAD > 0:  # slice 0 of the slot's h: this rank's partial shrink
        hv = tl.load(h_ptr + row * stride_ht + slot * stride_hl + r, mask=r < rank_on, other=0.0)
    row_at = part * part_numel + row * WORLD * P  # the row's packets in every buffer, by sending rank
    h_at = part * part_numel + h_start + row * WORLD * PH
    if not X_SENT:  # else the projection's GEMV sent the row (RowSend)
        send(buf_table_ptr, row_at + RANK * P, x, epoch, BLOCK, RANK, WORLD)
    if R_PAD > 0:
        send(buf_table_ptr, h_at + RANK * PH, hv, epoch, R_PAD, RANK, WORLD)
    acc = sum_ranks(buf_table_ptr, row_at, P, x, epoch, BLOCK, RANK, WORLD)
    if R_PAD > 0:
        h_acc = sum_ranks(buf_table_ptr, h_at, PH, hv, epoch, R_PAD, RANK, WORLD)
    tl.store(epoch_at, epoch)
    x = acc.to(x.dtype)  # rounded like the all-reduce's output
    if R_PAD > 0:
        h_sum = h_acc.to(x.dtype).to(tl.float32)  # rounded like the all-reduced h
        d = tl.where(rank_on > 0, tl.sum(h_sum[:, None] * bt.to(tl.float32), axis=0) * scale, 0.0)  # base: none
        x = (x.to(tl.float32) + d).to(x.dtype)
    if not HAS_RESIDUAL:  # the sum is the new residual
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    add_residual_and_norm(
        x, w, row, cols, mask, n_cols, eps, res_ptr, res_out_ptr, out_ptr, stride_res, stride_res_out, stride_out,
        HAS_RESIDUAL,
    )  # fmt: skip


def all_reduce_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]: this rank's partial sum (rows may be strided)
    residual: torch.Tensor | None,  # [num_tokens, hidden]; None: the new residual is x's sum
    weight: torch.Tensor,  # [hidden]
    eps: float,
    delta: LoraDelta | None,  # x's pending LoRA delta, its h this rank's partial shrink
    peers: PeerBuffers,
    part: int,  # which part of the buffer (consecutive calls take different ones)
    x_sent: bool = False,  # x's GEMV sent it to the peers already (RowSend of this part)
) -> tuple[torch.Tensor, torch.Tensor]:
    """normed, new_residual = x summed over the ranks (+ its LoRA delta) + residual, as
    kernels/fused.fused_add_rms_norm after an all-reduce of x and h. Every rank calls it with the
    same shapes; `fits` must hold."""
    assert fits(peers, x, delta) and 0 <= part < peers.num_parts
    assert not x_sent or (x.shape[0] == 1 and sends_whole_row(x.shape[1], 2))
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    num_tokens, hidden = x.shape
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens > 0:
        block, r_pad, pdl = triton.next_power_of_2(hidden), rank_pad(delta), pdl_enabled(x.device)
        _all_reduce_rms_norm_kernel[(num_tokens,)](
            x, x if residual is None else residual, weight, out, res_out, peers.buffer_ptrs, peers.epochs,
            x.stride(0), x.stride(0) if residual is None else residual.stride(0), out.stride(0), res_out.stride(0),
            part, peers.part_numel, h_area(peers.part_numel), peers.max_rows, hidden, eps, *delta_args(delta, x),
            RANK=peers.rank, WORLD=peers.world_size, BLOCK=block, R_PAD=r_pad, HAS_RESIDUAL=residual is not None,
            X_SENT=x_sent, PDL=pdl,
            num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
        )  # fmt: skip
    return out, res_out
