"""GPU: the decode kernels launched with programmatic dependent launch (kernels/pdl.py) give
bit-identical results to plain launches, in a chain where each kernel reads the one before
(GEMV -> residual-add RMSNorm with a LoRA delta -> GEMV -> RoPE + KV write -> decode
attention -> GEMV -> SiLU-mul with a delta -> GEMV), eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.lora_delta_data import SLOTS, make_delta
from tests.kernels.triton_device import DEVICE, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import ops, pdl  # noqa: E402
from ledgerserve.kernels.ops import rope_cos_sin_cache  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    requires_triton_device,
    pytest.mark.skipif(DEVICE != "cuda" or not pdl._capable(torch.device("cuda")), reason="needs sm_90+"),
]
H, HEADS, KV_HEADS, HEAD_DIM, D, BLOCK = 512, 8, 2, 64, 768, 16


def _chain(inputs: dict) -> list[torch.Tensor]:
    """One made-up decode layer over every row of x, each output feeding the next kernel."""
    x, residual, w = inputs["x"], inputs["residual"], inputs["weights"]
    rows = []
    for i in range(x.shape[0]):  # batch-1 steps: the GEMV path
        h = ops.linear(x[i : i + 1], w["in"])  # [1, H]
        rows.append(h)
    h = torch.cat(rows)  # [T, H]
    normed, residual = ops.fused_add_rms_norm(h, residual, w["norm"], 1e-5, inputs["delta_h"])
    qkv = torch.cat(
        [ops.linear(normed[i : i + 1], w["qkv"]) for i in range(h.shape[0])]
    )  # [T, (HEADS + 2 KV) * HEAD_DIM]
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
    ops.rope_and_write_kv(
        q, k, v, inputs["positions"], inputs["cos_sin"], inputs["k_cache"], inputs["v_cache"], inputs["kv_slots"]
    )
    attn = ops.paged_decode_attention(
        q, inputs["k_cache"], inputs["v_cache"], inputs["tables"], inputs["seq_lens"], HEAD_DIM**-0.5
    )  # [T, HEADS, HEAD_DIM]
    o = torch.cat([ops.linear(attn[i : i + 1].flatten(1), w["o"]) for i in range(h.shape[0])])  # [T, 2 D]
    act = ops.silu_and_mul(o, inputs["delta_gu"])  # [T, D]
    out = torch.cat([ops.linear(act[i : i + 1], w["down"]) for i in range(h.shape[0])])  # [T, H]
    return [normed, residual, qkv, inputs["k_cache"].clone(), attn, act, out]


def _inputs() -> dict:
    gen = torch.Generator().manual_seed(0)
    num_tokens = len(SLOTS)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    seq_lens = torch.tensor([37 + 5 * i for i in range(num_tokens)], dtype=torch.int32)
    width = 8
    tables = torch.arange(num_tokens * width, dtype=torch.int32).view(num_tokens, width)
    positions = (seq_lens - 1).long()
    kv_slots = tables[torch.arange(num_tokens), positions // BLOCK].long() * BLOCK + positions % BLOCK
    cache_shape = (num_tokens * width, BLOCK, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    return dict(
        x=randn(num_tokens, H),
        residual=randn(num_tokens, H),
        weights=dict(
            **{"in": randn(H, H, scale=H**-0.5)},
            norm=randn(H),
            qkv=randn((HEADS + 2 * KV_HEADS) * HEAD_DIM, H, scale=H**-0.5),
            o=randn(2 * D, HEADS * HEAD_DIM, scale=H**-0.5),
            down=randn(H, D, scale=D**-0.5),
        ),
        delta_h=make_delta([H], torch.bfloat16, DEVICE, seed=1),
        delta_gu=make_delta([D, D], torch.bfloat16, DEVICE, seed=2),
        positions=positions.to(DEVICE),
        cos_sin=rope_cos_sin_cache(inv_freq.to(DEVICE), 4096),
        kv_slots=kv_slots.to(DEVICE),
        k_cache=randn(*cache_shape),
        v_cache=randn(*cache_shape),
        tables=tables.to(DEVICE),
        seq_lens=seq_lens.to(DEVICE),
    )


def _run(monkeypatch: pytest.MonkeyPatch, on: bool, graph: bool) -> list[torch.Tensor]:
    monkeypatch.setenv("LEDGERSERVE_PDL", "1" if on else "0")
    inputs = _inputs()
    if not graph:
        return _chain(inputs)
    _chain(_inputs())  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _chain(inputs)
    g.replay()
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_pdl_launches_match_plain_launches(monkeypatch: pytest.MonkeyPatch, graph: bool) -> None:
    plain = _run(monkeypatch, False, graph)
    with_pdl = _run(monkeypatch, True, graph)
    for a, b in zip(plain, with_pdl):
        assert torch.equal(a, b)
    assert pdl.enabled(torch.device("cuda"))


def test_graph_edges_out_of_cublas_launch_at_block_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a captured graph, the two edges from a cuBLAS GEMM into a PDL kernel move to the launch-
    completion port (the PDL kernels' own edges stay), and the replay equals the eager run."""
    monkeypatch.setenv("LEDGERSERVE_PDL", "1")
    gen = torch.Generator().manual_seed(3)
    rows = len(SLOTS)  # > 1: cuBLAS, not the GEMV

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(DEVICE)

    x, residual, norm_w = randn(rows, H), randn(rows, H), randn(H)
    w_in, w_gu = randn(H, H, scale=H**-0.5), randn(2 * D, H, scale=H**-0.5)
    delta_h = make_delta([H], torch.bfloat16, DEVICE, seed=4)
    delta_gu = make_delta([D, D], torch.bfloat16, DEVICE, seed=5)

    def chain() -> list[torch.Tensor]:
        normed, new_residual = ops.fused_add_rms_norm(ops.linear(x, w_in), residual, norm_w, 1e-5, delta_h)
        return [normed, new_residual, ops.silu_and_mul(ops.linear(normed, w_gu), delta_gu)]

    eager = chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        outs = chain()
    assert pdl.launch_after_block_start(g.raw_cuda_graph()) == 2  # GEMM -> norm, GEMM -> SiLU-mul
    assert pdl.launch_after_block_start(g.raw_cuda_graph()) == 0  # nothing left to move
    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, outs):
        assert torch.equal(a, b)
