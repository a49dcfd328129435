"""Token-sorted expert blocks for the fused MoE kernels (kernels/fused_moe.py).

Each (token, k) pair a router chose is one row of work for its expert. The rows are sorted by
expert, and each expert's run is padded to a multiple of `block_m`, so that one program of the
grouped GEMM takes `block_m` rows that all belong to one expert and reads that expert's weights
once. Padding rows hold `num_pairs` (past every real pair), and blocks past the last run name
expert -1: the kernel skips both.

Torch ops only, none of which waits on the device: the shapes depend on the number of tokens
alone, so a CUDA graph can capture it for a decode batch size and replay it with any routing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SortedPairs(NamedTuple):
    pair_of_row: torch.Tensor  # [num_rows] int32: the pair (token * top_k + k) on each row; num_pairs on padding
    expert_of_block: torch.Tensor  # [num_rows // block_m] int32: each block's expert; -1 past the last run


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows the sorted table may need: every pair, plus under `block_m` rows of padding for each
    expert that has a pair, rounded up to whole blocks."""
    rows = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-rows // block_m) * block_m


def sort_pairs(
    expert_ids: torch.Tensor,  # [num_tokens, top_k] the router's choices
    num_experts: int,
    block_m: int,
) -> SortedPairs:
    flat = expert_ids.flatten().long()  # [num_pairs]
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [num_experts] rows of each expert's run
    run_ends = torch.cumsum(padded, 0)  # [num_experts]
    order = torch.argsort(flat, stable=True)  # [num_pairs] pairs in expert order
    expert = flat[order]
    rank = torch.arange(num_pairs, device=device) - (torch.cumsum(counts, 0) - counts)[expert]  # place in its run
    num_rows = max_rows(num_pairs, num_experts, block_m)
    pair_of_row = torch.full((num_rows,), num_pairs, dtype=torch.int32, device=device)
    pair_of_row.scatter_(0, run_ends[expert] - padded[expert] + rank, order.int())
    block_starts = torch.arange(0, num_rows, block_m, device=device)
    expert_of_block = torch.searchsorted(run_ends, block_starts, right=True)  # the run holding each block
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1).int()
    return SortedPairs(pair_of_row, expert_of_block)
