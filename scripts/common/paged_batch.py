"""Random paged-attention batches with a dense expected output: the kernel tests' inputs and
bench_kernels.py's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ledgerserve.kernels.attention_ref import write_kv


@dataclass
class PagedBatch:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim], the new tokens of every request
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], every position written
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32, padded with -1
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    expected: torch.Tensor  # [num_tokens, num_heads, head_dim] float32, dense causal SDPA
    max_query_len: int


def dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [q_len, heads, dim], the last q_len positions of k/v: [seq_len, kv_heads, dim]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril(diagonal=seq_len - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(),
        k.repeat_interleave(group, 1).transpose(0, 1).float(),
        v.repeat_interleave(group, 1).transpose(0, 1).float(),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)  # [q_len, heads, dim]


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_blocks: int = 3,  # padding columns in the block table beyond the longest request
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(need, default=0) + spare_blocks
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    qs, expected = [], []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens)):
        table = [perm.pop() for _ in range(need[i])]
        tables[i, : need[i]] = torch.tensor(table, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        write_kv(k, v, k_cache, v_cache, slots.long())
        q = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype)
        qs.append(q)
        expected.append(dense_causal(q, k, v, head_dim**-0.5) if seq_len else torch.zeros(q.shape))
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return PagedBatch(
        q=torch.cat(qs).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        block_tables=tables.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        expected=torch.cat(expected).to(device),
        max_query_len=max(q_lens, default=0),
    )
