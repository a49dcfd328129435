"""Triton routing for the fused MoE: the router's top-k (kernels/moe_ref.route) and the
token-sorted expert table (kernels/moe_align.sort_pairs), one launch each.

In a decode step the torch forms cost more than the experts' GEMMs: softmax, top-k and the
renormalisation are four launches a layer, and the sort (a radix argsort, cumulative sums, a
scatter, a search) about a dozen, ~40-70 us a layer on an H200 against ~25 us of expert GEMMs at
batch 1. Here one program per token routes it, and one program builds the whole table: it counts
each expert's pairs, lays out the padded runs, then places each pair at its run's start plus the
number of earlier pairs of its expert, CHUNK pairs at a time against a one-hot [CHUNK, E] tile.
One program is quick for a decode step's pairs (5 us at 8 tokens of top-8, 17 us at 32) but not
for a prefill chunk's (775 us at 2,048 tokens): fused_moe takes the torch sort past a bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.moe_align import SortedPairs, max_rows

CHUNK = 64  # pairs (or rows, or blocks) a step of the table kernel's loops takes


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr, E, stride_l,
    E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    logits = tl.load(logits_ptr + token * stride_l + e, mask=e < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(e < E, probs, -1.0)
    k = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), dtype=tl.float32)
    ids = tl.zeros((K_PAD,), dtype=tl.int64)
    for i in tl.static_range(TOP_K):  # the largest left (the lowest index among equals), then masked out
        best = tl.max(probs, axis=0)
        pick = tl.min(tl.where(probs == best, e, E_PAD), axis=0)
        weights = tl.where(k == i, best, weights)
        ids = tl.where(k == i, pick, ids)
        probs = tl.where(e == pick, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + k, weights, mask=k < TOP_K)
    tl.store(ids_ptr + token * TOP_K + k, ids, mask=k < TOP_K)


def route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [num_tokens, top_k] float32, expert ids [num_tokens, top_k] int64
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0),
            E_PAD=triton.next_power_of_2(num_experts), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize,
        )  # fmt: skip
    return weights, ids


@triton.jit
def _sort_pairs_kernel(
    ids_ptr, pair_of_row_ptr, expert_of_block_ptr, num_pairs, num_rows, num_blocks,
    E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    experts = tl.arange(0, E_PAD)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [E_PAD] rows of each expert's run
    ends = tl.cumsum(padded, axis=0)
    for r0 in range(0, num_rows, CHUNK):  # every row padding first; the pairs overwrite theirs
        r = r0 + tl.arange(0, CHUNK)
        tl.store(pair_of_row_ptr + r, tl.full((CHUNK,), 0, tl.int32) + num_pairs, mask=r < num_rows)
    tl.debug_barrier()
    next_row = ends - padded  # [E_PAD] where each expert's next pair goes
    for c0 in range(0, num_pairs, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + p, mask=p < num_pairs, other=-1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, E_PAD]
        earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs of the same expert before it in the chunk
        row = tl.sum(onehot * (next_row[None, :] + earlier), axis=1)
        tl.store(pair_of_row_ptr + row, p, mask=p < num_pairs)
        next_row += tl.sum(onehot, axis=0)
    for b0 in range(0, num_blocks, CHUNK):  # a block's expert: the number of runs ended at its start
        b = b0 + tl.arange(0, CHUNK)
        ended = tl.sum((ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(expert_of_block_ptr + b, tl.where(ended < E, ended, -1), mask=b < num_blocks)


def sort_pairs(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> SortedPairs:
    """kernels/moe_align.sort_pairs in one launch: expert_ids [num_tokens, top_k]."""
    flat = expert_ids.reshape(-1)
    num_pairs = flat.numel()
    num_rows = max_rows(num_pairs, num_experts, block_m)
    pair_of_row = torch.empty(num_rows, dtype=torch.int32, device=flat.device)
    expert_of_block = torch.empty(num_rows // block_m, dtype=torch.int32, device=flat.device)
    _sort_pairs_kernel[(1,)](
        flat, pair_of_row, expert_of_block, num_pairs, num_rows, num_rows // block_m,
        E=num_experts, E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m, CHUNK=CHUNK, num_warps=8,
    )  # fmt: skip
    return SortedPairs(pair_of_row, expert_of_block)
