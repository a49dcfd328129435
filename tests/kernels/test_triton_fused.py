"""GPU: Triton RMSNorm (+ residual), RoPE (+ KV-cache write) and SiLU-and-mul against the torch references."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.fused_ref import (
    apply_rope_ref,
    fused_add_rms_norm_ref,
    rms_norm_ref,
    rope_and_write_kv_ref,
    silu_and_mul_ref,
)
from ledgerserve.kernels.ops import rope_cos_sin_cache
from tests.kernels.lora_delta_data import SLOTS, make_delta, naive_delta
from tests.kernels.triton_device import DEVICE, DTYPES, TOL, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import fused  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
HIDDEN = [1000, 4096 + 8, 128]


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("num_tokens", [1, 17, 333])
def test_rms_norm(dtype: torch.dtype, hidden: int, num_tokens: int) -> None:
    x, weight = randn(num_tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    out = fused.rms_norm(x, weight, 1e-6)
    assert out.dtype == dtype
    torch.testing.assert_close(out, rms_norm_ref(x, weight, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_strided_view(dtype: torch.dtype) -> None:
    """Qwen3's q/k norm: [tokens, heads, head_dim] views out of the fused qkv output."""
    qkv = randn(17, 9 * 128, dtype=dtype)
    q = qkv[:, : 7 * 128].view(17, 7, 128)
    weight = randn(128, dtype=dtype, seed=2)
    out = fused.rms_norm(q, weight, 1e-6)
    torch.testing.assert_close(out, rms_norm_ref(q, weight, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_fused_add_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    x, residual = randn(333, hidden, dtype=dtype), randn(333, hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    normed, new_residual = fused.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(new_residual, ref_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 128), (7, 1, 64), (7, 7, 128)])
def test_rope_in_place_on_qkv_views(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    num_tokens = 333
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v_before = qkv[:, (num_heads + num_kv_heads) * head_dim :].clone()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cache = rope_cos_sin_cache(inv_freq, 4096)
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rope_ref(q_ref, k_ref, positions, cache)
    fused.apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(qkv[:, (num_heads + num_kv_heads) * head_dim :], v_before)


def qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [num_tokens, num_heads, head_dim], k, v [num_tokens, num_kv_heads, head_dim]: views of one qkv output."""
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, -1, head_dim), v.view(num_tokens, -1, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(28, 4, 128), (7, 1, 64), (7, 7, 128)])
@pytest.mark.parametrize("num_tokens", [1, 333])
def test_rope_and_write_kv_on_qkv_views(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int
) -> None:
    max_position, block_size = 4096, 16
    num_blocks = num_tokens // block_size + 3  # room for slots the batch does not touch
    q, k, v = qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cos_sin_cache = rope_cos_sin_cache(inv_freq, max_position)  # [max_position, head_dim]
    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, max_position, (num_tokens,), generator=gen).to(DEVICE)  # [num_tokens]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(DEVICE)  # [num_tokens] int64
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = randn(*cache_shape, dtype=dtype, seed=6), randn(*cache_shape, dtype=dtype, seed=7)
    q_ref, k_ref, v_ref = q.clone(), k.clone(), v.clone()
    k_cache_ref, v_cache_ref = k_cache.clone(), v_cache.clone()
    rope_and_write_kv_ref(q_ref, k_ref, v_ref, positions, cos_sin_cache, k_cache_ref, v_cache_ref, slots)
    fused.rope_and_write_kv(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slots)
    torch.testing.assert_close(q, q_ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(k, k_ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(v, v_ref)
    flat_k, flat_v = k_cache.view(-1, num_kv_heads, head_dim), v_cache.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k)  # the kernel's own rotated k, bit for bit
    assert torch.equal(flat_v[slots], v)
    torch.testing.assert_close(k_cache, k_cache_ref, atol=TOL[dtype], rtol=TOL[dtype])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], k_cache_ref.view(-1, num_kv_heads, head_dim)[untouched])
    assert torch.equal(v_cache, v_cache_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1000, 4096 + 8, 14336])
@pytest.mark.parametrize("num_tokens", [1, 17, 333])
def test_silu_and_mul(dtype: torch.dtype, d: int, num_tokens: int) -> None:
    x = randn(num_tokens, 2 * d, dtype=dtype)
    out = fused.silu_and_mul(x)
    assert out.shape == (num_tokens, d) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1000, 4096 + 8])
def test_fused_add_rms_norm_adds_pending_lora_delta(dtype: torch.dtype, hidden: int) -> None:
    delta = make_delta([hidden], dtype, DEVICE)
    x, residual = randn(len(SLOTS), hidden, dtype=dtype), randn(len(SLOTS), hidden, dtype=dtype, seed=1)
    weight = randn(hidden, dtype=dtype, seed=2)
    normed, new_residual = fused.fused_add_rms_norm(x, residual, weight, 1e-5, delta)
    ref_normed, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5, delta)
    torch.testing.assert_close(new_residual, ref_residual, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(normed, ref_normed, atol=TOL[dtype], rtol=TOL[dtype])
    with_delta = x.double().cpu() + naive_delta(delta, [hidden])
    assert (new_residual.double().cpu() - residual.double().cpu() - with_delta).abs().max() < 0.1  # the delta is in


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [1000, 2048 + 24])
def test_silu_and_mul_adds_pending_lora_delta(dtype: torch.dtype, d: int) -> None:
    delta = make_delta([d, d], dtype, DEVICE)
    x = randn(len(SLOTS), 2 * d, dtype=dtype)
    out = fused.silu_and_mul(x, delta)
    torch.testing.assert_close(out, silu_and_mul_ref(x, delta), atol=TOL[dtype], rtol=TOL[dtype])
