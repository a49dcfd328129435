"""Paged reference attention (the new K/V written, then attended over) vs dense SDPA on contiguous
tensors, at odd sizes."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ledgerserve.kernels.attention_ref import paged_prefill_attention_ref, write_kv
from ledgerserve.worker_proc.step_inputs import padded_tables


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,
    starts: list[int],
    seq_lens: list[int],
    tables: list[list[int]],
    kv_slots: list[int],
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """What the model's attention does on the CPU: write the new K/V, then attend (host lists in)."""
    write_kv(k, v, k_cache, v_cache, torch.tensor(kv_slots, dtype=torch.long))
    flat, width = padded_tables(tables)
    block_tables = torch.tensor(flat, dtype=torch.int32).view(len(tables), width)
    as_int32 = (torch.tensor(starts, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32))
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, *as_int32, scale)


def dense_reference(q_full: torch.Tensor, k_full: torch.Tensor, v_full: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention over a whole sequence, contiguous. q_full: [seq, heads, dim]."""
    group = q_full.shape[1] // k_full.shape[1]
    out = F.scaled_dot_product_attention(
        q_full.transpose(0, 1),
        k_full.repeat_interleave(group, 1).transpose(0, 1),
        v_full.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
        scale=scale,
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [(3, 6, 2, 5), (16, 4, 4, 8), (1, 3, 1, 7)])
def test_paged_matches_dense(block_size: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    # (num_computed, num_new): decode, prefill from empty, chunk with cached prefix, single token prompt
    shapes = [(11, 1), (0, 13), (7, 5), (0, 1), (block_size, 2)]
    num_blocks = 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)
    scale = head_dim**-0.5
    qs, ks, vs, slots, starts, seq_lens, tables, expected = [], [], [], [], [0], [], [], []
    for num_computed, num_new in shapes:
        seq_len = num_computed + num_new
        table = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        q_full = torch.randn(seq_len, num_heads, head_dim, generator=gen)
        k_full = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v_full = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        for pos in range(num_computed):  # the cached prefix, as an earlier step left it
            k_cache[table[pos // block_size], pos % block_size] = k_full[pos]
            v_cache[table[pos // block_size], pos % block_size] = v_full[pos]
        qs.append(q_full[num_computed:])
        ks.append(k_full[num_computed:])
        vs.append(v_full[num_computed:])
        slots += [table[p // block_size] * block_size + p % block_size for p in range(num_computed, seq_len)]
        starts.append(starts[-1] + num_new)
        seq_lens.append(seq_len)
        tables.append(table)
        expected.append(dense_reference(q_full, k_full, v_full, scale)[num_computed:])
    args = (starts, seq_lens, tables, slots, scale)
    out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, *args)
    torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)


def test_short_block_table_raises() -> None:
    k_cache = torch.zeros(4, 2, 1, 4)
    q = torch.randn(3, 1, 4)
    with pytest.raises(ValueError):
        paged_attention(q, q, q, k_cache, k_cache.clone(), [0, 3], [3], [[0]], [0, 1, 2], 0.5)
