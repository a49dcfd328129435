"""Triton prefill attention over the paged KV cache, with a cached prefix.

Variable-length batch: request i's new queries are q[query_start_loc[i]:query_start_loc[i+1]],
the last of its seq_lens[i] positions. Their K/V are already in the cache (`write_kv`),
so every key, cached or new, is read through the block table. Each program takes one
(request, kv head) and BLOCK_Q = BLOCK_M // GROUP of the request's queries for each of the
GROUP query heads that share the kv head (row r: query r // GROUP, head r % GROUP of the group),
and runs an online softmax over the causal key range: the group reads each K/V tile once.
Reference: attention_ref.paged_prefill_attention_ref.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.attention_tiles import BLOCK_M, queries_per_tile

BLOCK_N = 64  # keys per tile
NUM_WARPS = 4
NUM_STAGES = 3  # 64x64 tiles, 4 warps, 3 stages: the best of 8 configs swept on H200


@triton.jit
def _attend_tile(
    q, m, l, acc, n0, end, q_pos,
    k_cache_ptr, v_cache_ptr, table_ptr, kv_head, offs_d, d_mask,
    scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over keys [n0, n0 + BLOCK_N) read through the block table."""
    toks = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
    t_mask = toks < end
    blocks = tl.load(table_ptr + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    in_block = toks % BLOCK_SIZE
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k_off = blocks * stride_kb + in_block * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    s = tl.dot(q, tl.trans(k)) * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
    if MASKED:
        s = tl.where((toks[None, :] <= q_pos[:, None]) & t_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v_off = blocks * stride_vb + in_block * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


# stride_bt is the batch's widest block table: not specialized (on == 1 or % 16), so no batch recompiles
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    tile_reqs_ptr, tile_starts_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, TILED: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(1)
    if TILED:  # program 0 axis: a row of the tile table (request, first query); request -1 is padding
        req = tl.load(tile_reqs_ptr + tl.program_id(0)).to(tl.int64)
        if req < 0:
            return
        m0 = tl.load(tile_starts_ptr + tl.program_id(0)).to(tl.int32)
    else:  # program (tile, kv head, request)
        req = tl.program_id(2).to(tl.int64)
        m0 = tl.program_id(0) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if m0 >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)

    offs_r = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows: (query, head of the group)
    offs_m = m0 + offs_r // GROUP  # [BLOCK_M] index among this request's new tokens
    heads = kv_head * GROUP + offs_r % GROUP  # [BLOCK_M] query head
    offs_d = tl.arange(0, D_PAD)
    m_mask = (offs_r < BLOCK_Q * GROUP) & (offs_m < q_len)
    d_mask = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # fmt: skip  [BLOCK_M, D_PAD]
    q_pos = seq_len - q_len + offs_m  # [BLOCK_M] absolute positions
    end = tl.minimum(seq_len, seq_len - q_len + m0 + BLOCK_Q)  # keys past the tile's last query are unused

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_base = req * stride_bt
    # keys below the tile's first query position are visible to every row: no mask
    full_end = (seq_len - q_len + m0) // BLOCK_N * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        m, l, acc = _attend_tile(
            q, m, l, acc, n0, end, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + kv_base, kv_head, offs_d, d_mask,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, BLOCK_N, False,
        )  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):  # the diagonal: causal and length masks
        m, l, acc = _attend_tile(
            q, m, l, acc, n0, end, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr + kv_base, kv_head, offs_d, d_mask,
            scale_log2, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_SIZE, BLOCK_N, True,
        )  # fmt: skip

    out = acc / l[:, None]
    o_ptr = out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptr, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, cached + new tokens
    scale: float,
    max_query_len: int | None = None,  # longest q_len in the batch; computed (a host sync) if None
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None,  # request, first query row: [num_tiles] int64 each
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """With `tiles` (attention_tiles' table for this GQA group, padded with request -1), the grid
    is the table's rows by the kv heads, whatever the batch: a CUDA graph captures it once for
    every batch that fits. Rows of q outside every request are left zero."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    num_reqs, group = seq_lens.shape[0], num_heads // num_kv_heads
    block_q = queries_per_tile(group)
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if tiles is not None:
        grid: tuple[int, ...] = (tiles[0].shape[0], num_kv_heads)
    else:
        if max_query_len is None:
            max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
        grid = (triton.cdiv(max_query_len, block_q), num_kv_heads, num_reqs)
    if num_tokens == 0 or 0 in grid:
        return out
    tile_reqs, tile_starts = tiles if tiles is not None else (seq_lens, seq_lens)  # unread without tiles
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, query_start_loc, seq_lens, tile_reqs, tile_starts,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        HEAD_DIM=head_dim, D_PAD=max(16, triton.next_power_of_2(head_dim)), GROUP=group,
        BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M, BLOCK_Q=block_q, BLOCK_N=BLOCK_N, TILED=tiles is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    return out
