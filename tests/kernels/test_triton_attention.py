"""GPU: Triton paged decode (split-K) and prefill attention against the torch reference."""

from __future__ import annotations

import pytest
import torch

from scripts.common.paged_batch import make_paged_batch
from tests.kernels.triton_device import DEVICE, DTYPES, INTERPRET, TOL, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import ops  # noqa: E402
from ledgerserve.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402
from ledgerserve.kernels.attention_tiles import attention_tiles, max_attention_tiles  # noqa: E402
from ledgerserve.kernels.paged_attention import paged_decode_attention  # noqa: E402
from ledgerserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]

# num_heads, num_kv_heads, head_dim: GQA groups of 7, 4, 1 and 7 (MQA)
HEADS = [(28, 4, 128), (28, 7, 64), (7, 7, 128), (7, 1, 64)]
DOT_DTYPES = DTYPES
if INTERPRET:  # slow; and the interpreter's bf16 tl.dot is wrong (triton 3.6)
    HEADS, DOT_DTYPES = HEADS[1:2], [torch.float16]


def as_float(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.float() for t in tensors]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_decode(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    seq_lens = [1, 17, 333, 1029, 0, 256, 257]  # 0: padding row; 256/257: partition edges
    b = make_paged_batch([1] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, DEVICE)
    scale = head_dim**-0.5
    # q as a strided view, the way it comes out of a fused qkv projection
    q = torch.cat([b.q, torch.randn_like(b.q[:, :1])], dim=1)[:, :num_heads]
    out = paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale)
    ref = paged_decode_attention_ref(*as_float(b.q, b.k_cache, b.v_cache), b.block_tables, b.seq_lens, scale)
    assert out.dtype == dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(ref, b.expected, atol=1e-4, rtol=1e-4)
    if DEVICE == "cuda":  # under the interpreter ops takes the CPU reference
        assert torch.equal(ops.paged_decode_attention(q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale), out)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEADS)
def test_prefill_with_cached_prefix(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    # (new queries, seq_len): from empty, after a cached prefix, a chunk past many tiles, one-token tail
    q_lens, seq_lens = [1, 17, 17, 333, 29, 1, 130], [1, 17, 33, 333, 1029, 700, 1029]
    if INTERPRET:
        q_lens, seq_lens = [1, 17, 70], [1, 33, 200]
    b = make_paged_batch(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, 16, dtype, DEVICE)
    args = (b.block_tables, b.query_start_loc, b.seq_lens, head_dim**-0.5)
    out = paged_prefill_attention(b.q, b.k_cache, b.v_cache, *args, max_query_len=b.max_query_len)
    ref = paged_prefill_attention_ref(*as_float(b.q, b.k_cache, b.v_cache), *args)
    assert out.dtype == dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(ref, b.expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(paged_prefill_attention(b.q, b.k_cache, b.v_cache, *args), out)  # max_query_len computed
    group = num_heads // num_kv_heads
    num_tiles = max_attention_tiles(b.q.shape[0], len(q_lens), group) + 3  # a graph bucket's table: padded rows
    table = attention_tiles(b.query_start_loc.tolist(), num_tiles, group)
    tiles = tuple(torch.tensor(t, dtype=torch.long, device=b.q.device) for t in table)
    assert torch.equal(paged_prefill_attention(b.q, b.k_cache, b.v_cache, *args, tiles=tiles), out)
    if DEVICE == "cuda":
        assert torch.equal(ops.paged_prefill_attention(b.q, b.k_cache, b.v_cache, *args), out)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
def test_decode_matches_prefill_on_last_token(dtype: torch.dtype) -> None:
    """A one-token prefill chunk and a decode step are the same attention."""
    seq_lens = [5, 1029, 600]
    b = make_paged_batch([1, 1, 1], seq_lens, 28, 4, 128, 16, dtype, DEVICE, seed=3)
    scale = 128**-0.5
    decode = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale)
    prefill = paged_prefill_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale, 1
    )
    torch.testing.assert_close(decode.float(), prefill.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("programs_per_sm", [0, 10**6])  # the largest and the smallest partition
def test_decode_partition_sizes(programs_per_sm: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from ledgerserve.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "PROGRAMS_PER_SM", programs_per_sm)
    seq_lens = [1, 64, 65, 511, 512, 513, 1029]
    b = make_paged_batch([1] * len(seq_lens), seq_lens, 28, 4, 128, 16, DOT_DTYPES[-1], DEVICE, seed=7)
    out = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 128**-0.5)
    ref = paged_decode_attention_ref(*as_float(b.q, b.k_cache, b.v_cache), b.block_tables, b.seq_lens, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[DOT_DTYPES[-1]], rtol=TOL[DOT_DTYPES[-1]])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("direct_pairs_per_sm", [0, 10**6])  # one partition written directly; split + reduce
def test_decode_short_contexts_one_partition(
    dtype: torch.dtype, direct_pairs_per_sm: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contexts within one partition: the partition kernel writes the output (zeros for a padding
    row) and no reduce runs, or the split path; both equal the reference."""
    from ledgerserve.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "DIRECT_PAIRS_PER_SM", direct_pairs_per_sm)
    seq_lens = [1, 64, 65, 0, 200, 511, 512]  # 0: padding row
    b = make_paged_batch([1] * len(seq_lens), seq_lens, 28, 4, 128, 16, dtype, DEVICE, seed=11)
    tables = b.block_tables[:, : paged_attention.MAX_PARTITION // 16].contiguous()  # as wide as one partition
    out = paged_decode_attention(b.q, b.k_cache, b.v_cache, tables, b.seq_lens, 128**-0.5)
    ref = paged_decode_attention_ref(*as_float(b.q, b.k_cache, b.v_cache), tables, b.seq_lens, 128**-0.5)
    torch.testing.assert_close(out.float(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert not out[3].any()  # the padding row
