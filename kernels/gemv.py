"""Triton GEMV: y = x W^T (+ b) for a single token row, the batch-1 decode step.

cuBLAS reaches 2.6-3.7 TB/s on Llama-3-8B's smaller projections at one row on an H200
(o_proj 4096 x 4096: 13.0 us), and its split-K picks add a reduce launch. Here each program
owns BLOCK_N output features and streams their rows of W over K in BLOCK_K chunks, so every
byte of W is read once, coalesced along K, with no split and no second launch (o_proj:
10.6 us). Configurations per shape class are the best of scripts/decode/probe_gemv_configs.py's sweep
over block sizes, warps and stages on an H100, at Llama-3-8B's shapes whole and split in two by
tensor parallelism. With PDL (kernels/pdl.py) a program
loads its first chunk of W before the previous kernel has finished. Reference: torch.nn.functional.linear.

With a RowSend (a row-parallel projection at tensor parallel > 1), each program also sends its
columns of the row to every other rank's buffer as packets (kernels/packets.py) as soon as it has
them, at the epoch the fused all-reduce norm consuming the row will await: the row is on its way
while the last programs still run, and that kernel only waits for the peers' rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.all_reduce_norm import row_send_at, sends_whole_row
from ledgerserve.kernels.packets import send
from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous
from ledgerserve.kernels.peer_buffers import RowSend


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, table_ptr, send_at, epoch_ptr, send_cols,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SEND: tl.constexpr,
    RANK: tl.constexpr, WORLD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = n < N
    rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w = tl.load(
        rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0
    )  # the first chunk, before x exists
    wait_for_previous(PDL)  # x is the previous kernel's output
    x = tl.load(x_ptr + k, mask=k < K, other=0.0)
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)  # [BLOCK_K]
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + n, y, mask=n_mask)
    n0 = tl.program_id(0) * BLOCK_N
    if SEND and n0 < send_cols:  # the row's columns, not a stacked LoRA A's shrink past them
        send(table_ptr, send_at + n0 // 2, y, tl.load(epoch_ptr) + 1, BLOCK_N, RANK, WORLD)


# Where the sweep's best beat the rules below by more than 2%: (n, k) -> configuration
MEASURED_BEST = {
    (3072, 4096): (8, 2048, 4, 1)  # qkv at TP 2: 8.87 us against the rule's 9.71
}


def gemv_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) from the H100 sweep: each of Llama-3-8B's shapes,
    whole and at TP 2 (lm_head's too), runs within 1% of its best configuration. A program's first
    BLOCK_K of W loads before the previous kernel has finished (PDL), so wide chunks win, but not
    the whole row: with nothing left to load after the wait, o at TP 2 (4096 x 2048) runs 9% slower or more."""
    if (n, k) in MEASURED_BEST:
        return MEASURED_BEST[(n, k)]
    if k <= 2048:
        return 2, 1024, 4, 2
    return 2, 2048, 8, 1


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: tuple[int, int, int, int] | None = None,
    row_send: RowSend | None = None,
) -> torch.Tensor:
    """x: [1, K], weight: [N, K] (rows may be strided), bias: [N] or None -> [1, N]. `config`:
    (BLOCK_N, BLOCK_K, num_warps, num_stages), else gemv_config's for the shape. `row_send`: where
    the first row_send.num_cols columns also go as packets (sends_row must hold)."""
    n, k = weight.shape
    assert x.shape == (1, k) and x.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config or gemv_config(n, k)
    pdl = pdl_enabled(x.device)
    if row_send is not None:
        assert sends_row(n, k, row_send.num_cols, config)
        peers = row_send.peers
        send_args = (peers.buffer_ptrs, row_send_at(row_send), peers.epochs[row_send.part], row_send.num_cols)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, x if bias is None else bias, y, n, k, weight.stride(0),
        *(send_args if row_send is not None else (x, 0, x, 0)),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, SEND=row_send is not None,
        RANK=0 if row_send is None else row_send.peers.rank, WORLD=0 if row_send is None else row_send.peers.world_size,
        PDL=pdl, num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return y


def sends_row(n: int, k: int, num_cols: int, config: tuple[int, int, int, int] | None = None) -> bool:
    """Whether gemv's programs for weights [n, k] can send the row's first num_cols columns whole."""
    block_n = (config or gemv_config(n, k))[0]
    return num_cols <= n and sends_whole_row(num_cols, block_n)
