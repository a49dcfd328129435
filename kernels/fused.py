"""Triton fused elementwise kernels: RMSNorm (+ residual add), RoPE in place, RoPE in place
fused with the paged KV-cache write (rope_and_write_kv), SiLU-and-mul.

References with the same signatures: kernels/fused_ref.py. Every kernel reads and
writes in the tensors' dtype and computes in float32, rounding where the model rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ledgerserve.kernels.lora_delta import delta_args, lora_b_tile, lora_row_delta, lora_tile_delta, rank_pad
from ledgerserve.kernels.lora_types import LoraDelta
from ledgerserve.kernels.pdl import enabled as pdl_enabled
from ledgerserve.kernels.pdl import wait_for_previous

PREFETCH_B_ELEMS = 16 * 4096  # B elements a norm program holds to load them before gdc_wait (rank 16, hidden 4096)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_res, stride_out, stride_res_out,
    n_cols, eps,
    h_ptr, b_ptr, scalings_ptr, lora_slots_ptr, max_rank, stride_ht, stride_hl, stride_hs,
    stride_bl, stride_bs, stride_bo, stride_br,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, R_PAD: tl.constexpr, PREFETCH_B: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if R_PAD > 0:
        lora_slot = tl.load(lora_slots_ptr + row)  # the step's input row: written before the graph ran
        if PREFETCH_B:  # B before the wait: its latency hides behind the previous kernel
            bt, scale = lora_b_tile(
                b_ptr, scalings_ptr, lora_slot, 0, 1, max_rank, cols, mask, stride_bl, stride_bs, stride_bo, stride_br,
                R_PAD,
            )  # fmt: skip
    wait_for_previous(PDL)  # x, residual and h come from earlier kernels
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if R_PAD > 0:  # x's pending LoRA delta (one slice)
        if PREFETCH_B:
            d = lora_tile_delta(h_ptr + row * stride_ht, lora_slot, 0, max_rank, bt, scale, stride_hl, stride_hs, R_PAD)
        else:
            d = lora_row_delta(
                h_ptr + row * stride_ht, b_ptr, scalings_ptr, lora_slot, 0, 1, max_rank, cols, mask,
                stride_hl, stride_hs, stride_bl, stride_bs, stride_bo, stride_br, BLOCK, R_PAD,
            )  # fmt: skip
        x = (x.to(tl.float32) + d).to(x.dtype)
    add_residual_and_norm(
        x, w, row, cols, mask, n_cols, eps, res_ptr, res_out_ptr, out_ptr, stride_res, stride_res_out, stride_out,
        HAS_RESIDUAL,
    )  # fmt: skip


@triton.jit
def add_residual_and_norm(
    x, w, row, cols, mask, n_cols, eps, res_ptr, res_out_ptr, out_ptr, stride_res, stride_res_out, stride_out,
    HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The end of a norm program's row x [BLOCK] (its delta added): x + residual stored as the new
    residual (HAS_RESIDUAL), then its RMSNorm times w [BLOCK] float32 stored, rounded as HF rounds."""
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded like `x + residual`
        tl.store(res_out_ptr + row * stride_res_out + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, axis=0) / n_cols + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)  # cast back before the weight, like HF
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rms_norm_launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, delta: LoraDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)  # [rows, hidden]
    out = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = residual.reshape(-1, hidden) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if x2.shape[0] > 0:
        block = triton.next_power_of_2(hidden)
        r_pad, pdl = rank_pad(delta), pdl_enabled(x.device)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps, *delta_args(delta, x2),
            HAS_RESIDUAL=residual is not None, BLOCK=block, R_PAD=r_pad, PREFETCH_B=r_pad * block <= PREFETCH_B_ELEMS,
            PDL=pdl, num_warps=min(16, max(1, block // 256)), launch_pdl=pdl,
        )  # fmt: skip
    new_res = res_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden], weight: [hidden] -> [..., hidden]."""
    assert x.stride(-1) == 1 and weight.is_contiguous()
    return _rms_norm_launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, delta: LoraDelta | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [num_tokens, hidden] -> normed, new_residual = x (+ its LoRA delta) + residual."""
    assert x.shape == residual.shape and x.stride(-1) == 1 and residual.stride(-1) == 1
    normed, new_residual = _rms_norm_launch(x, residual, weight, eps, delta)
    assert new_residual is not None
    return normed, new_residual


@triton.jit
def _first_halves(row_ptr, stride_h, n_heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Pointers to the first half of each of one token's heads at row_ptr, and the mask of real heads:
    [HEADS_PAD, HALF] and [HEADS_PAD, 1]. The second halves are at + HALF."""
    heads = tl.arange(0, HEADS_PAD)
    offs = tl.arange(0, HALF)
    return row_ptr + heads[:, None] * stride_h + offs[None, :], (heads < n_heads)[:, None]


@triton.jit
def _load_halves(row_ptr, stride_h, n_heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """One token's heads at row_ptr, as their first and second halves: [HEADS_PAD, HALF] each."""
    ptr1, mask = _first_halves(row_ptr, stride_h, n_heads, HALF, HEADS_PAD)
    return tl.load(ptr1, mask=mask, other=0.0), tl.load(ptr1 + HALF, mask=mask, other=0.0)


@triton.jit
def _store_halves(row_ptr, stride_h, n_heads, x1, x2, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Store the halves x1, x2 ([HEADS_PAD, HALF]) of one token's heads, cast to row_ptr's dtype."""
    ptr1, mask = _first_halves(row_ptr, stride_h, n_heads, HALF, HEADS_PAD)
    tl.store(ptr1, x1.to(row_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr1 + HALF, x2.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotated_halves(row_ptr, stride_h, n_heads, cos, sin, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """One token's heads rotated by cos, sin ([HALF] float32): the two halves [HEADS_PAD, HALF]
    computed in float32 and rounded to the heads' dtype."""
    x1, x2 = _load_halves(row_ptr, stride_h, n_heads, HALF, HEADS_PAD)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    r1 = (a * cos[None, :] - b * sin[None, :]).to(x1.dtype)
    r2 = (b * cos[None, :] + a * sin[None, :]).to(x1.dtype)
    return r1, r2


@triton.jit
def _rope_heads(row_ptr, stride_h, n_heads, cos, sin, HALF: tl.constexpr, HEADS_PAD: tl.constexpr):
    """Rotate one token's heads in place."""
    r1, r2 = _rotated_halves(row_ptr, stride_h, n_heads, cos, sin, HALF, HEADS_PAD)
    _store_halves(row_ptr, stride_h, n_heads, r1, r2, HALF, HEADS_PAD)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, token, stride_cache, HALF: tl.constexpr):
    """cos, sin at the token's position: [HALF] float32 each."""
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, HALF)
    return tl.load(cache_ptr + pos * stride_cache + offs), tl.load(cache_ptr + pos * stride_cache + HALF + offs)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cache,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, token, stride_cache, HALF)
    _rope_heads(q_ptr + token * stride_qt, stride_qh, n_q_heads, cos, sin, HALF, Q_HEADS_PAD)
    _rope_heads(k_ptr + token * stride_kt, stride_kh, n_k_heads, cos, sin, HALF, K_HEADS_PAD)


def _check_rope_args(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> int:
    """HALF (head_dim // 2) for the kernels, after checking the layouts they assume."""
    head_dim = q.shape[-1]
    half = head_dim // 2
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.shape[-1] == head_dim and half == triton.next_power_of_2(half)
    return half


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], rotated in
    place at positions [num_tokens]; cos_sin_cache: [max_position, head_dim] float32."""
    half = _check_rope_args(q, k, cos_sin_cache)
    if q.shape[0] == 0:
        return
    _rope_kernel[(q.shape[0],)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
    )  # fmt: skip


@triton.jit
def _rope_and_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cache_ptr, k_cache_ptr, v_cache_ptr, kv_slot_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cache,
    stride_kv_slot, stride_kv_slot_h,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per token: rotate its q and k heads in place, store k and v at its KV cache slot."""
    token = tl.program_id(0).to(tl.int64)
    cos, sin = _cos_sin(pos_ptr, cache_ptr, token, stride_cache, HALF)  # the step's positions: before the wait
    kv_slot = tl.load(kv_slot_ptr + token).to(tl.int64)  # flat: block * block_size + offset
    wait_for_previous(PDL)  # q, k, v come from the qkv projection
    _rope_heads(q_ptr + token * stride_qt, stride_qh, n_q_heads, cos, sin, HALF, Q_HEADS_PAD)
    k_row = k_ptr + token * stride_kt
    k1, k2 = _rotated_halves(k_row, stride_kh, n_k_heads, cos, sin, HALF, K_HEADS_PAD)
    _store_halves(k_row, stride_kh, n_k_heads, k1, k2, HALF, K_HEADS_PAD)
    _store_halves(k_cache_ptr + kv_slot * stride_kv_slot, stride_kv_slot_h, n_k_heads, k1, k2, HALF, K_HEADS_PAD)
    v1, v2 = _load_halves(v_ptr + token * stride_vt, stride_vh, n_k_heads, HALF, K_HEADS_PAD)
    _store_halves(v_cache_ptr + kv_slot * stride_kv_slot, stride_kv_slot_h, n_k_heads, v1, v2, HALF, K_HEADS_PAD)


def rope_and_write_kv(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens] int
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] float32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    kv_slots: torch.Tensor,  # [num_tokens] int64 flat cache slot of each token
) -> None:
    """apply_rope, then the rotated k and v stored at kv_slots, in one launch (no host sync)."""
    half = _check_rope_args(q, k, cos_sin_cache)
    assert v.stride(-1) == 1 and v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == k.shape[1:]
    if q.shape[0] == 0:
        return
    pdl = pdl_enabled(q.device)
    _rope_and_write_kv_kernel[(q.shape[0],)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, kv_slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos_sin_cache.stride(0),
        k_cache.stride(1), k_cache.stride(2),
        q.shape[1], k.shape[1],
        HALF=half, Q_HEADS_PAD=triton.next_power_of_2(q.shape[1]), K_HEADS_PAD=triton.next_power_of_2(k.shape[1]),
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, d,
    h_ptr, b_ptr, scalings_ptr, lora_slots_ptr, max_rank, stride_ht, stride_hl, stride_hs,
    stride_bl, stride_bs, stride_bo, stride_br,
    BLOCK: tl.constexpr, R_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    wait_for_previous(PDL)  # x and h come from the gate_up projection
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    if R_PAD > 0:  # the pending LoRA delta of slices gate (0) and up (1)
        lora_slot = tl.load(lora_slots_ptr + row)
        h_row = h_ptr + row * stride_ht
        d_gate = lora_row_delta(
            h_row, b_ptr, scalings_ptr, lora_slot, 0, 2, max_rank, cols, mask, stride_hl, stride_hs,
            stride_bl, stride_bs, stride_bo, stride_br, BLOCK, R_PAD,
        )  # fmt: skip
        d_up = lora_row_delta(
            h_row, b_ptr, scalings_ptr, lora_slot, 1, 2, max_rank, cols, mask, stride_hl, stride_hs,
            stride_bl, stride_bs, stride_bo, stride_br, BLOCK, R_PAD,
        )  # fmt: skip
        gate = (gate.to(tl.float32) + d_gate).to(gate.dtype)
        up = (up.to(tl.float32) + d_up).to(up.dtype)
    up = up.to(tl.float32)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # rounded like F.silu(gate)
    tl.store(out_ptr + row * stride_out + cols, (silu * up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, delta: LoraDelta | None = None) -> torch.Tensor:
    """x: [num_tokens, 2 * d] (+ its LoRA delta over slices gate, up) -> silu(gate) * up: [num_tokens, d]."""
    assert x.stride(-1) == 1
    d = x.shape[-1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    block = 1024
    pdl = pdl_enabled(x.device)
    if x.shape[0] > 0:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, block))](
            x, out, x.stride(0), out.stride(0), d, *delta_args(delta, x),
            BLOCK=block, R_PAD=rank_pad(delta), PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out
