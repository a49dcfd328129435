"""Triton fused MoE: the sparse MLP of kernels/moe_ref.py as two grouped GEMMs over token-sorted
expert blocks (kernels/moe_align.py), one launch each.

    pairs [num_tokens * top_k]: token t's k-th choice is pair t * top_k + k
    h   = x[pair // top_k] @ w13[expert]^T           [num_pairs, 2 * intermediate]   (gate rows, up rows)
    act = silu(gate) * up                            [num_pairs, intermediate]       (kernels/fused.py)
    y   = (act @ w2[expert]^T) * routing weight      [num_pairs, hidden]
    out = y summed over each token's top_k pairs     [num_tokens, hidden]                (in float32)

A program owns BLOCK_M rows of one expert (padding rows and blocks past the last run do nothing)
and BLOCK_N output features, and streams that expert's weight rows over K, so each expert's
weights are read once per block of its tokens. Nothing waits on the host: a decode step's MoE is
captured in its CUDA graph. Reference: kernels/moe_ref.fused_moe_ref.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels import moe_align, moe_route
from ledgerserve.kernels.fused import silu_and_mul
from ledgerserve.kernels.moe_align import SortedPairs

MAX_PAIRS_ONE_PROGRAM = 512  # past this many pairs, the torch sort (many programs) beats the one-program table


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, c_ptr, pair_of_row_ptr, expert_of_block_ptr, weight_ptr,
    N, K, num_pairs, top_k, stride_am, stride_we, stride_wn, stride_cm,
    A_PER_TOKEN: tl.constexpr, SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    block = tl.program_id(0)
    expert = tl.load(expert_of_block_ptr + block)
    if expert < 0:
        return
    pairs = tl.load(pair_of_row_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    valid = pairs < num_pairs
    a_rows = pairs // top_k if A_PER_TOKEN else pairs  # x has a row per token, act a row per pair
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_mask = n < N
    k = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    a_ptrs = a_ptr + a_rows[:, None].to(tl.int64) * stride_am + k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [BK, BN]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k + k0 < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALE:
        acc = acc * tl.load(weight_ptr + pairs, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs[:, None].to(tl.int64) * stride_cm + n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


@triton.jit
def _sum_top_k_kernel(y_ptr, out_ptr, N, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (token * TOP_K + k).to(tl.int64) * N + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + token.to(tl.int64) * N + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


def block_sizes(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps) by the pairs an expert gets on average: a decode step's
    few rows an expert take small row blocks (less padding) and long K chunks (weights streamed)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16, 64, 128, 4
    if per_expert <= 64:
        return 32, 64, 64, 4
    return 64, 128, 64, 8


def _expert_gemm(
    a: torch.Tensor,  # [num_tokens or num_pairs, K]
    w: torch.Tensor,  # [num_experts, N, K]
    out: torch.Tensor,  # [num_pairs, N], written on the real rows
    sorted_pairs: SortedPairs,
    top_k: int,
    weights: torch.Tensor | None,  # [num_pairs] float32: scale each row by its routing weight
    blocks: tuple[int, int, int, int],
    a_per_token: bool,  # a has a row per token (x), not per pair (act)
) -> None:
    block_m, block_n, block_k, warps = blocks
    assert a.stride(-1) == 1 and w.stride(-1) == 1 and out.stride(-1) == 1
    num_pairs, n = out.shape
    grid = (sorted_pairs.expert_of_block.numel(), triton.cdiv(n, block_n))
    _expert_gemm_kernel[grid](
        a, w, out, sorted_pairs.pair_of_row, sorted_pairs.expert_of_block, weights if weights is not None else out,
        n, a.shape[1], num_pairs, top_k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_PER_TOKEN=a_per_token, SCALE=weights is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=3,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * intermediate, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, intermediate]
    weights: torch.Tensor,  # [num_tokens, top_k] float32
    ids: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:  # [num_tokens, hidden]
    num_tokens, top_k = ids.shape
    num_experts, num_pairs = w13.shape[0], num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    blocks = block_sizes(num_pairs, num_experts)
    sort = moe_route.sort_pairs if num_pairs <= MAX_PAIRS_ONE_PROGRAM else moe_align.sort_pairs
    sorted_pairs = sort(ids, num_experts, blocks[0])
    h = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _expert_gemm(x, w13, h, sorted_pairs, top_k, None, blocks, a_per_token=True)
    act = silu_and_mul(h)  # [num_pairs, intermediate]
    y = torch.empty((num_pairs, w2.shape[1]), dtype=x.dtype, device=x.device)
    _expert_gemm(act, w2, y, sorted_pairs, top_k, weights.flatten().float().contiguous(), blocks, a_per_token=False)
    out = torch.empty_like(x)  # [num_tokens, hidden]: each token's top_k rows of y summed
    _sum_top_k_kernel[(num_tokens, triton.cdiv(out.shape[1], 1024))](y, out, out.shape[1], TOP_K=top_k, BLOCK_N=1024)
    return out
