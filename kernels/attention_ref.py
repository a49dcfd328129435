"""Torch reference paged attention (CPU and CUDA), with the signatures of kernels/ops.py.

Each request in the flat batch has `num_computed` tokens whose K/V were already in its
blocks and `num_new` new query tokens, whose K/V `write_kv` put at `kv_slots` first; every
new query attends causally over all of that request's `num_computed + num_new` keys, read
back through its block table. One function serves prefill chunks (with or without a cached
prefix) and decode.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`. A flat slot index is
`block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    kv_slots: torch.Tensor,  # [num_tokens] int64 flat cache slot of each new token
) -> None:
    """Scatter new K/V into the paged cache, in place."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, kv_slots, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, kv_slots, v.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: list[int],
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    if num_blocks > len(block_table):
        raise ValueError(f"block table has {len(block_table)} blocks, {num_blocks} needed for {seq_len} tokens")
    index = torch.tensor(block_table[:num_blocks], dtype=torch.long, device=cache.device)
    return cache.index_select(0, index).flatten(0, 1)[:seq_len]


def causal_attention(
    q: torch.Tensor,  # [num_new, num_heads, head_dim], the last num_new positions of the sequence
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    v: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    num_new, seq_len = q.shape[0], k.shape[0]
    if num_new > seq_len:
        raise ValueError(f"{num_new} queries but only {seq_len} keys")
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [seq_len, num_heads, head_dim]
    v = v.repeat_interleave(group, dim=1)
    query_pos = torch.arange(seq_len - num_new, seq_len, device=q.device)  # [num_new]
    key_pos = torch.arange(seq_len, device=q.device)  # [seq_len]
    mask = key_pos[None, :] <= query_pos[:, None]  # [num_new, seq_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )  # [num_heads, num_new, head_dim]
    return out.transpose(0, 1)


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, cached + new tokens
    scale: float,
    max_query_len: int | None = None,  # unused here; the Triton kernel sizes its grid by it
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,  # unused here: the Triton kernel's grid
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Each request's new queries attend causally over its cached + new keys."""
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    starts, lens, tables = query_start_loc.tolist(), seq_lens.tolist(), block_tables.tolist()
    for i, seq_len in enumerate(lens):
        start, end = starts[i], starts[i + 1]
        if end == start or seq_len == 0:
            continue
        keys = gather_kv(k_cache, tables[i], seq_len).to(q.dtype)  # [seq_len, num_kv_heads, head_dim]
        values = gather_kv(v_cache, tables[i], seq_len).to(q.dtype)
        out[start:end] = causal_attention(q[start:end], keys, values, scale)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim], one new token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    seq_lens: torch.Tensor,  # [num_reqs] int32, including the new token; 0 = padding row (zeros out)
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_prefill_attention_ref(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
