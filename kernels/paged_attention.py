"""Triton decode attention over the paged KV cache, split-K (flash-decoding).

Each program takes one (request, kv head, partition of `partition_size` keys): the query heads
of that kv head's GQA group share every K/V tile it loads. It writes the partition's
normalised output, running max and exp-sum; a reduce kernel merges the partitions. When one
partition covers every sequence (short contexts and enough (request, kv head) pairs to fill
the SMs), the partition kernel writes the output itself and no reduce is launched.
The grid is sized from the block table's width, never from seq_lens, so a launch needs
no host sync and can be captured in a CUDA graph. Reference: attention_ref.paged_decode_attention_ref.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous

MAX_PARTITION = 512  # keys per split-K partition, halved down to BLOCK_N for small batches
BLOCK_N = 64  # keys per tile inside a partition
PROGRAMS_PER_SM = 4  # enough programs in flight to keep the memory system busy (swept 1..32 on H200)
DIRECT_PAIRS_PER_SM = 1  # (request, kv head) pairs per SM from which short contexts take one partition, no reduce


@functools.lru_cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def partition_size(num_reqs: int, num_kv_heads: int, max_len: int, num_sms: int) -> int:
    """One partition when it covers max_len and the pairs alone give every SM DIRECT_PAIRS_PER_SM
    programs; else the largest partition that still gives every SM PROGRAMS_PER_SM programs."""
    if max_len <= MAX_PARTITION and num_reqs * num_kv_heads >= DIRECT_PAIRS_PER_SM * num_sms:
        return MAX_PARTITION
    partition = MAX_PARTITION
    while partition > BLOCK_N and num_reqs * num_kv_heads * triton.cdiv(max_len, partition) < PROGRAMS_PER_SM * num_sms:
        partition //= 2
    return partition


@triton.jit
def _store_heads(base_ptr, heads, offs_d, stride_h, vals, mask):
    """vals [GROUP_PAD, D_PAD] into rows `heads` at base_ptr (heads stride_h apart), in base_ptr's dtype."""
    tl.store(base_ptr + heads[:, None] * stride_h + offs_d[None, :], vals.to(base_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _attend(
    q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, start, end, scale_log2, offs_d, d_mask,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax of q [GROUP_PAD, D_PAD] over keys [start, end) of one request (its block
    table row at table_ptr): running max m and exp-sum l [GROUP_PAD], unnormalised acc [GROUP_PAD, D_PAD]."""
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        t_mask = toks < end
        blocks = tl.load(table_ptr + toks // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
        in_block = toks % BLOCK_SIZE
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k_off = blocks * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_cache_ptr + k_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        v_off = blocks * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k)) * scale_log2  # [GROUP_PAD, BLOCK_N], log2 domain
        s = tl.where(t_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    return m, l, acc


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_or, stride_oh, stride_op,
    stride_mr, stride_mh,
    stride_ot, stride_oth,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """DIRECT: one partition covers every sequence; write the output [num_reqs, num_heads, head_dim]
    (zeros for a padding row) instead of the partials."""
    req, kv_head, part = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    wait_for_previous(PDL)  # q and this step's K/V come from the kernels before
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads of this kv head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    hd_mask = g_mask[:, None] & d_mask[None, :]
    seq_len = tl.load(seq_lens_ptr + req)
    q = tl.load(
        q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0
    )  # [GROUP_PAD, D_PAD], in flight with seq_len
    start = part * PARTITION
    if start >= seq_len:
        if DIRECT:  # a padding row (seq_len 0)
            _store_heads(
                out_ptr + req * stride_ot, heads, offs_d, stride_oth, tl.zeros([GROUP_PAD, D_PAD], tl.float32), hd_mask
            )
        return
    m, l, acc = _attend(
        q,
        k_cache_ptr,
        v_cache_ptr,
        block_tables_ptr + req * stride_bt,
        kv_head,
        start,
        tl.minimum(start + PARTITION, seq_len),
        scale_log2,
        offs_d,
        d_mask,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_vb,
        stride_vs,
        stride_vh,
        GROUP_PAD,
        D_PAD,
        BLOCK_SIZE,
        BLOCK_N,
    )
    if DIRECT:
        _store_heads(out_ptr + req * stride_ot, heads, offs_d, stride_oth, acc / l[:, None], hd_mask)
        return
    _store_heads(part_out_ptr + req * stride_or + part * stride_op, heads, offs_d, stride_oh, acc / l[:, None], hd_mask)
    stat = req * stride_mr + heads * stride_mh + part
    tl.store(part_max_ptr + stat, m, mask=g_mask)
    tl.store(part_sum_ptr + stat, l, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, seq_lens_ptr, out_ptr,
    stride_or, stride_oh, stride_op,
    stride_mr, stride_mh,
    stride_qt, stride_qh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    wait_for_previous(PDL)  # the partials come from the partition kernel
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < HEAD_DIM
    out = out_ptr + req * stride_qt + head * stride_qh + offs_d
    seq_len = tl.load(seq_lens_ptr + req)
    if seq_len == 0:  # a padding row
        tl.store(out, tl.zeros([D_PAD], tl.float32).to(out_ptr.dtype.element_ty), mask=d_mask)
        return
    n_parts = tl.cdiv(seq_len, PARTITION)
    stats = part_max_ptr + req * stride_mr + head * stride_mh
    sums = part_sum_ptr + req * stride_mr + head * stride_mh
    o_base = part_out_ptr + req * stride_or + head * stride_oh + offs_d
    m = tl.load(stats)
    l = tl.load(sums)
    acc = tl.load(o_base, mask=d_mask, other=0.0) * l  # [D_PAD]
    for p in range(1, n_parts):
        m_p = tl.load(stats + p)
        l_p = tl.load(sums + p)
        m_new = tl.maximum(m, m_p)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_p - m_new) * l_p
        acc = acc * alpha + tl.load(o_base + p * stride_op, mask=d_mask, other=0.0) * beta
        l = l * alpha + beta
        m = m_new
    tl.store(out, (acc / l).to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,  # [num_reqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32, padded
    seq_lens: torch.Tensor,  # [num_reqs] int32; 0 = padding row (zeros out)
    scale: float,
) -> torch.Tensor:  # [num_reqs, num_heads, head_dim]
    num_reqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and block_tables.stride(-1) == 1
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    partition = partition_size(num_reqs, num_kv_heads, max_len, _num_sms(q.device))
    num_parts = max(1, triton.cdiv(max_len, partition))
    direct = num_parts == 1
    parts = 0 if direct else num_parts  # the partials are not written when direct
    part_out = torch.empty(num_reqs, num_heads, parts, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_reqs, num_heads, parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_reqs == 0:
        return out
    d_pad = max(16, triton.next_power_of_2(head_dim))
    pdl = pdl_enabled(q.device)
    _decode_partition_kernel[(num_reqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens,
        part_out, part_max, part_sum, out,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, PARTITION=partition, BLOCK_N=BLOCK_N, DIRECT=direct, PDL=pdl, num_warps=4,
        launch_pdl=pdl,
    )  # fmt: skip
    if direct:
        return out
    _decode_reduce_kernel[(num_reqs, num_heads)](
        part_out, part_max, part_sum, seq_lens, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_max.stride(0), part_max.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, D_PAD=d_pad, PARTITION=partition, PDL=pdl, num_warps=1, launch_pdl=pdl,
    )  # fmt: skip
    return out
