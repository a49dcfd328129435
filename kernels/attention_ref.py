"""Torch reference paged attention (CPU and CUDA).

One function serves prefill chunks (with or without a cached prefix) and decode: each
request in the flat batch has `num_computed` tokens whose K/V are already in its blocks
and `num_new` new query tokens. The new K/V are written into the cache at
`slot_mapping`, then every new query attends causally over all of that request's
`num_computed + num_new` keys, read back through its block table.

Cache layout: `[num_blocks, block_size, num_kv_heads, head_dim]`. A flat slot index is
`block_id * block_size + offset_in_block`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Batch layout shared by every layer of one forward pass."""

    query_start_loc: list[int]  # [num_reqs + 1] offsets of each req's new tokens in the flat batch
    seq_lens: list[int]  # [num_reqs] num_computed + num_new per req
    block_tables: list[list[int]]  # per req: block ids covering its seq_len tokens
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat cache slot of each new token

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)


def write_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter new K/V into the paged cache, in place."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


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


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    meta: PagedAttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Write new K/V into the cache, then causal GQA attention of the new queries.

    Apart from the cache write at `meta.slot_mapping` it is a pure function of its inputs.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if meta.slot_mapping.shape[0] != q.shape[0] or meta.query_start_loc[-1] != q.shape[0]:
        raise ValueError("slot_mapping / query_start_loc do not match the number of tokens")
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    for i in range(meta.num_reqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if end == start:
            continue
        seq_len = meta.seq_lens[i]
        keys = gather_kv(k_cache, meta.block_tables[i], seq_len)  # [seq_len, num_kv_heads, head_dim]
        values = gather_kv(v_cache, meta.block_tables[i], seq_len)
        out[start:end] = causal_attention(q[start:end], keys.to(q.dtype), values.to(q.dtype), scale)
    return out


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


# Tensor-metadata forms of the same attention, with the signatures of kernels/ops.py. The
# K/V of the new tokens must already be in the cache (`write_kv`).


def paged_prefill_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, cached + new tokens
    scale: float,
    max_query_len: int | None = None,  # unused here; the Triton kernel sizes its grid by it
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
