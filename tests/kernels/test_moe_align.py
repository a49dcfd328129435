"""The token-sorted expert table of the fused MoE kernels: every (token, k) pair on exactly one row,
each block's rows all of its expert, padding rows past every pair, within the sized bound."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.moe_align import max_rows, sort_pairs


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("seed", range(6))
def test_every_pair_once_in_a_block_of_its_expert(seed: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_tokens = int(torch.randint(1, 300, (1,), generator=gen))
    num_experts, top_k = [(4, 1), (8, 2), (128, 8), (6, 2), (16, 4), (60, 4)][seed]
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if seed % 2:  # a skewed router: most pairs on expert 0 or 1
        ids[: num_tokens // 2, 0] = seed % num_experts
    table = sort_pairs(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    rows = table.pair_of_row.tolist()
    assert len(rows) == max_rows(num_pairs, num_experts, block_m) and len(rows) % block_m == 0
    assert sorted(r for r in rows if r < num_pairs) == list(range(num_pairs))  # each pair once
    assert all(r == num_pairs for r in rows if r >= num_pairs)  # padding
    flat, blocks = ids.flatten().tolist(), table.expert_of_block.tolist()
    assert len(blocks) == len(rows) // block_m
    for b, expert in enumerate(blocks):
        pairs = [r for r in rows[b * block_m : (b + 1) * block_m] if r < num_pairs]
        if expert < 0:
            assert not pairs  # past the last run
        else:
            assert pairs and all(flat[p] == expert for p in pairs)
    used = [e for e in blocks if e >= 0]
    assert used == sorted(used) and set(used) == set(flat)  # runs in expert order, one per expert hit
