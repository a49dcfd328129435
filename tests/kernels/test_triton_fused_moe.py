"""GPU: the Triton fused MoE against the torch reference, odd sizes and skewed routing, and
captured in a CUDA graph with one routing, replayed with another; its routing and sorted table
against their torch forms."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels.moe_ref import fused_moe_ref, route
from tests.kernels.triton_device import DEVICE, DTYPES, TOL, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import fused_moe, moe_align, moe_route  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]


def _weights(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(1)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) / intermediate**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def _routing(num_tokens: int, num_experts: int, top_k: int, seed: int, skew: bool = False):
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    if skew:
        logits[:, 0] += 4.0  # most tokens pick expert 0
    return route(logits, top_k, renormalize=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k,hidden,intermediate",
    [(1, 8, 2, 200, 72), (7, 128, 8, 256, 96), (64, 16, 4, 136, 40), (333, 60, 4, 512, 176), (2048, 8, 2, 128, 64)],
)
def test_matches_reference(dtype, num_tokens, num_experts, top_k, hidden, intermediate) -> None:
    w13, w2 = _weights(num_experts, hidden, intermediate, dtype)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(2)).to(dtype).to(DEVICE)
    for skew in (False, True):
        weights, ids = _routing(num_tokens, num_experts, top_k, 3, skew)
        got = fused_moe.fused_moe(x, w13, w2, weights, ids)
        want = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_graph_replays_with_new_routing() -> None:
    dtype, num_tokens, num_experts, top_k = torch.bfloat16, 32, 128, 8
    w13, w2 = _weights(num_experts, 256, 96, dtype)
    x = torch.randn(num_tokens, 256, device=DEVICE, dtype=dtype)
    weights, ids = _routing(num_tokens, num_experts, top_k, 4)
    fused_moe.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe.fused_moe(x, w13, w2, weights, ids)
    for seed in (5, 6):
        new_weights, new_ids = _routing(num_tokens, num_experts, top_k, seed, skew=seed == 6)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        want = fused_moe_ref(x.float(), w13.float(), w2.float(), new_weights, new_ids)
        torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (7, 60, 6), (333, 128, 8), (64, 5, 1)])
def test_routing_matches_torch(num_tokens: int, num_experts: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    weights, ids = moe_route.route(logits, top_k, renormalize)  # float32: no ties
    want_weights, want_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    half = logits.to(torch.bfloat16)  # ties: any of the tied experts, the same weights
    weights, ids = moe_route.route(half, top_k, renormalize)
    want_weights, _ = route(half, top_k, renormalize)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)
    probs = torch.softmax(half.float(), dim=-1).gather(1, ids)
    chosen = probs / probs.sum(dim=-1, keepdim=True) if renormalize else probs
    torch.testing.assert_close(chosen, want_weights, atol=1e-6, rtol=1e-5)
    assert all(len(set(row)) == top_k for row in ids.tolist())


@pytest.mark.parametrize("block_m", [16, 64])
@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (7, 60, 6), (333, 128, 8), (2048, 8, 2)])
def test_sorted_table_equals_torch(num_tokens: int, num_experts: int, top_k: int, block_m: int) -> None:
    _, ids = _routing(num_tokens, num_experts, top_k, 10, skew=num_tokens > 100)
    got, want = moe_route.sort_pairs(ids, num_experts, block_m), moe_align.sort_pairs(ids, num_experts, block_m)
    assert torch.equal(got.pair_of_row, want.pair_of_row)  # pairs of an expert in pair order, both
    assert torch.equal(got.expert_of_block, want.expert_of_block)
