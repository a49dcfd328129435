"""CPU: the kernel references and kernels/ops.py dispatch against independent torch math."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels import ops
from ledgerserve.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref, write_kv
from ledgerserve.kernels.fused_ref import apply_rope_ref, fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref
from ledgerserve.worker_proc.models.config import RopeConfig
from ledgerserve.worker_proc.models.layers import RMSNorm
from ledgerserve.worker_proc.models.rope import RotaryEmbedding
from scripts.common.paged_batch import make_paged_batch
from tests.kernels.lora_delta_data import SLOTS, make_delta, naive_delta

HEADS = [(7, 1, 16), (6, 3, 8), (4, 4, 32)]  # num_heads, num_kv_heads, head_dim


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
def test_decode_ref_matches_dense(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    seq_lens = [1, 17, 333, 0, 40]  # 0: a padding row, zeros out
    b = make_paged_batch(
        [1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, block_size, torch.float32, "cpu"
    )
    scale = head_dim**-0.5
    out = paged_decode_attention_ref(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale)
    torch.testing.assert_close(out, b.expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        ops.paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale), out
    )


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_prefill_ref_matches_dense(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    q_lens, seq_lens = [1, 17, 17, 33, 5], [1, 17, 33, 333, 1029]  # from empty, and after cached prefixes
    b = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, torch.float32, "cpu")
    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, head_dim**-0.5)
    out = paged_prefill_attention_ref(*args)
    torch.testing.assert_close(out, b.expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ops.paged_prefill_attention(*args, max_query_len=b.max_query_len), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_formula_and_model(dtype: torch.dtype) -> None:
    x = torch.randn(5, 1000).to(dtype)
    weight = (torch.rand(1000) + 0.5).to(dtype)
    x64 = x.double()
    direct = (x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()) * weight.double()
    out = rms_norm_ref(x, weight, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), direct, atol=tol, rtol=tol)
    layer = RMSNorm(1000, 1e-6).to(dtype)
    layer.weight.data.copy_(weight)
    assert torch.equal(layer(x), out)  # the model's layer takes the same op
    assert torch.equal(ops.rms_norm(x, weight, 1e-6), out)


def test_fused_add_rms_norm() -> None:
    x, residual = torch.randn(3, 4104).bfloat16(), torch.randn(3, 4104).bfloat16()
    weight = torch.rand(4104).bfloat16()
    normed, new_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, rms_norm_ref(x + residual, weight, 1e-5))
    got = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got[0], normed) and torch.equal(got[1], new_residual)


def rope_complex(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE as a complex rotation of (x[i], x[i + half]) pairs, in float64."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())  # [tokens, heads, half]
    angle = positions.double()[:, None, None] * inv_freq.double()[None, None, :]
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), dim=-1)


def rope_hf(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """HF Llama's RoPE: float32 cos/sin of the angles, the rotation computed in x's dtype."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [tokens, half]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [tokens, 1, head_dim]
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rope_matches_complex_rotation_and_hf(rope_type: str) -> None:
    head_dim = 64
    rope = RopeConfig(theta=500000.0, rope_type=rope_type, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)  # fmt: skip
    rotary = RotaryEmbedding(rope, head_dim, 2048)
    cache = rotary.cos_sin_cache(torch.device("cpu"))
    positions = torch.tensor([0, 1, 17, 333, 2047])
    q, k = torch.randn(5, 7, head_dim), torch.randn(5, 1, head_dim)
    q_out, k_out = q.clone(), k.clone()
    apply_rope_ref(q_out, k_out, positions, cache)
    torch.testing.assert_close(q_out.double(), rope_complex(q, positions, rotary.inv_freq), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(k_out.double(), rope_complex(k, positions, rotary.inv_freq), atol=1e-4, rtol=1e-4)
    qb, kb = q.bfloat16(), k.bfloat16()
    expect_q, expect_k = rope_hf(qb, positions, rotary.inv_freq), rope_hf(kb, positions, rotary.inv_freq)
    ops.apply_rope(qb, kb, positions, cache)
    assert torch.equal(qb, expect_q) and torch.equal(kb, expect_k)


def test_rope_in_place_on_qkv_views() -> None:
    qkv = torch.randn(4, (6 + 2 * 2) * 32)
    q = qkv[:, : 6 * 32].view(4, 6, 32)
    k = qkv[:, 6 * 32 : 8 * 32].view(4, 2, 32)
    v_before = qkv[:, 8 * 32 :].clone()
    cache = ops.rope_cos_sin_cache(1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32)), 16)
    positions = torch.tensor([3, 0, 15, 7])
    expect_q = rope_complex(q.clone(), positions, 1.0 / (10000.0 ** (torch.arange(0, 32, 2).float() / 32)))
    ops.apply_rope(q, k, positions, cache)
    torch.testing.assert_close(q.double(), expect_q, atol=1e-5, rtol=1e-5)
    assert torch.equal(qkv[:, 8 * 32 :], v_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_write_kv_is_rope_then_write_kv(dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 5, 6, 2, 32, 4
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))  # views of qkv
    cache = ops.rope_cos_sin_cache(1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 16)
    positions = torch.tensor([3, 0, 15, 7, 7])
    slots = torch.tensor([9, 2, 17, 0, 10])  # shuffled, non-contiguous, across blocks
    k_cache = torch.randn(5, block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(5, block_size, num_kv_heads, head_dim).to(dtype)
    q_ref, k_ref, v_ref, k_cache_ref, v_cache_ref = (t.clone() for t in (q, k, v, k_cache, v_cache))
    apply_rope_ref(q_ref, k_ref, positions, cache)
    write_kv(k_ref, v_ref, k_cache_ref, v_cache_ref, slots)
    ops.rope_and_write_kv(q, k, v, positions, cache, k_cache, v_cache, slots)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref), (k_cache, k_cache_ref), (v_cache, v_cache_ref)):
        assert torch.equal(got, want)


def test_silu_and_mul() -> None:
    x = torch.randn(3, 2 * 1000)
    direct = x[:, :1000] * torch.sigmoid(x[:, :1000]) * x[:, 1000:]
    torch.testing.assert_close(silu_and_mul_ref(x), direct)
    assert torch.equal(ops.silu_and_mul(x), silu_and_mul_ref(x))


def test_pending_lora_delta_is_added_before_the_norm_and_the_activation() -> None:
    """o / down's LoRA delta added by the residual-add norm, gate_up's by SiLU-and-mul."""
    gen = torch.Generator().manual_seed(7)
    hidden, d = 40, 24
    delta = make_delta([hidden], torch.float32, "cpu")
    x, residual = torch.randn(len(SLOTS), hidden, generator=gen), torch.randn(len(SLOTS), hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    want = fused_add_rms_norm_ref(x + naive_delta(delta, [hidden]).float(), residual, weight, 1e-6)
    got = ops.fused_add_rms_norm(x, residual, weight, 1e-6, delta)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[1][1], (x + residual)[1])  # a base token: no delta
    gate_up = make_delta([d, d], torch.float32, "cpu", seed=1)
    x2 = torch.randn(len(SLOTS), 2 * d, generator=gen)
    want2 = silu_and_mul_ref(x2 + naive_delta(gate_up, [d, d]).float())
    torch.testing.assert_close(ops.silu_and_mul(x2, gate_up), want2)


def test_linear_is_f_linear_on_cpu() -> None:
    gen = torch.Generator().manual_seed(3)
    x, w, b = torch.randn(1, 9, generator=gen), torch.randn(5, 9, generator=gen), torch.randn(5, generator=gen)
    assert torch.equal(ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


def test_vocab_embedding_shards_sum_to_the_whole_table() -> None:
    """The CPU path (the reference): ids another shard holds give zeros, so the shards' rows add up to
    the table's; a padded shard's rows past the vocabulary are never read."""
    from ledgerserve.kernels import ops

    table = torch.randn(10, 6, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([0, 4, 5, 9, 7])
    shards = [table[:5], torch.cat([table[5:], torch.full((1, 6), float("nan"))])]  # the second padded
    got = [ops.vocab_embedding(ids, shard, first) for shard, first in zip(shards, (0, 5), strict=True)]
    assert torch.equal(got[0][1:3], torch.stack([table[4], torch.zeros(6)]))
    assert torch.equal(got[0] + got[1], table[ids])
