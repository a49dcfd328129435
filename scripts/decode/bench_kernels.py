"""Time each Triton kernel against its torch reference on CUDA, and print their max error.

    python3 -m scripts.decode.bench_kernels

Shapes are Qwen2-7B-like (28 query heads, 4 kv heads, head_dim 128, hidden 3584,
intermediate 18944), bf16, block_size 16. Errors are max |triton - ref| where the
reference runs in float32 on the same bf16/fp16 inputs.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ledgerserve.kernels import fused  # noqa: E402
from ledgerserve.kernels.attention_ref import paged_decode_attention_ref, paged_prefill_attention_ref  # noqa: E402
from ledgerserve.kernels.fused_ref import apply_rope_ref, fused_add_rms_norm_ref, rms_norm_ref, silu_and_mul_ref  # noqa: E402
from ledgerserve.kernels.ops import rope_cos_sin_cache  # noqa: E402
from ledgerserve.kernels.paged_attention import paged_decode_attention  # noqa: E402
from ledgerserve.kernels.prefill_attention import paged_prefill_attention  # noqa: E402
from scripts.common.paged_batch import make_paged_batch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 28, 4, 128, 3584, 18944


def row(name: str, triton_fn: Callable[[], object], ref_fn: Callable[[], object], note: str = "") -> None:
    t_triton = do_bench(triton_fn, warmup=10, rep=50) * 1e3
    t_graph = do_bench_cudagraph(triton_fn, rep=50) * 1e3  # GPU time alone, no launch overhead
    t_ref = do_bench(ref_fn, warmup=3, rep=30) * 1e3
    print(f"| {name:<38} | {t_triton:>10.1f} | {t_graph:>10.1f} | {t_ref:>10.1f} | {t_ref / t_triton:>7.1f}x | {note}")


def attention_rows() -> None:
    scale = HEAD_DIM**-0.5
    for num_reqs, seq_len in [(1, 4096), (32, 1029), (64, 2048), (256, 1029)]:
        b = make_paged_batch(
            [1] * num_reqs, [seq_len] * num_reqs, HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16, "cuda"
        )
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, scale)
        t = do_bench_cudagraph(lambda: paged_decode_attention(*args), rep=50) * 1e-3
        gbs = 2 * num_reqs * seq_len * KV_HEADS * HEAD_DIM * 2 / t / 1e9
        row(f"decode {num_reqs}x{seq_len}", lambda: paged_decode_attention(*args),
            lambda: paged_decode_attention_ref(*args), f"{gbs:.0f} GB/s of KV in a graph")  # fmt: skip
    for num_reqs, q_len, seq_len in [(4, 512, 1024), (1, 2048, 2048), (8, 128, 1029)]:
        b = make_paged_batch(
            [q_len] * num_reqs, [seq_len] * num_reqs, HEADS, KV_HEADS, HEAD_DIM, 16, torch.bfloat16, "cuda"
        )
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.seq_lens, scale)
        row(f"prefill {num_reqs}x(q {q_len}, seq {seq_len})", lambda: paged_prefill_attention(*args, b.max_query_len),
            lambda: paged_prefill_attention_ref(*args))  # fmt: skip


def fused_rows() -> None:
    x = torch.randn(4096, HIDDEN, device="cuda", dtype=torch.bfloat16)
    res, w = torch.randn_like(x), torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    row("rms_norm 4096x3584", lambda: fused.rms_norm(x, w, 1e-6), lambda: rms_norm_ref(x, w, 1e-6))
    row("fused_add_rms_norm 4096x3584", lambda: fused.fused_add_rms_norm(x, res, w, 1e-6),
        lambda: fused_add_rms_norm_ref(x, res, w, 1e-6))  # fmt: skip
    row("rms_norm 64x3584 (decode)", lambda: fused.rms_norm(x[:64], w, 1e-6), lambda: rms_norm_ref(x[:64], w, 1e-6))
    q = torch.randn(4096, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(4096, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    cache = rope_cos_sin_cache(inv_freq, 32768)
    pos = torch.randint(0, 32768, (4096,), device="cuda")
    row(
        "rope 4096 tokens 28+4 heads",
        lambda: fused.apply_rope(q, k, pos, cache),
        lambda: apply_rope_ref(q, k, pos, cache),
    )
    gu = torch.randn(4096, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    row("silu_and_mul 4096x(2x18944)", lambda: fused.silu_and_mul(gu), lambda: silu_and_mul_ref(gu))


def max_errors() -> None:
    """Odd sizes, float32 reference on the low-precision inputs."""
    for dtype in (torch.bfloat16, torch.float16):
        b = make_paged_batch([1] * 5, [1, 17, 333, 1029, 4000], 28, 4, 128, 16, dtype, "cuda")
        f = [t.float() for t in (b.q, b.k_cache, b.v_cache)]
        dec = paged_decode_attention(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, 128**-0.5)
        dec_ref = paged_decode_attention_ref(*f, b.block_tables, b.seq_lens, 128**-0.5)
        b = make_paged_batch([1, 17, 333, 29], [1, 33, 333, 1029], 28, 7, 64, 16, dtype, "cuda")
        f = [t.float() for t in (b.q, b.k_cache, b.v_cache)]
        meta = (b.block_tables, b.query_start_loc, b.seq_lens, 64**-0.5)
        pre = paged_prefill_attention(b.q, b.k_cache, b.v_cache, *meta)
        pre_ref = paged_prefill_attention_ref(*f, *meta)
        x = torch.randn(333, 4104, device="cuda").to(dtype)
        w = torch.randn(4104, device="cuda").to(dtype)
        norm_err = (fused.rms_norm(x, w, 1e-6).float() - rms_norm_ref(x.float(), w.float(), 1e-6)).abs().max()
        gu = torch.randn(333, 2000, device="cuda").to(dtype)
        silu_err = (fused.silu_and_mul(gu).float() - silu_and_mul_ref(gu.float())).abs().max()
        errors = f"rms_norm {norm_err:.2e}  silu_and_mul {silu_err:.2e}"
        print(f"{str(dtype):<15} max|err| decode {(dec.float() - dec_ref).abs().max():.2e}  "
              f"prefill {(pre.float() - pre_ref).abs().max():.2e}  {errors}")  # fmt: skip


def main() -> None:
    print(torch.cuda.get_device_name())
    print(f"| {'op (bf16)':<38} | {'triton us':>10} | {'graph us':>10} | {'torch us':>10} | speedup  |")
    print(f"|{'-' * 40}|{'-' * 12}|{'-' * 12}|{'-' * 12}|{'-' * 10}|")
    attention_rows()
    fused_rows()
    max_errors()


if __name__ == "__main__":
    main()
