"""GPU: cuBLASLt's candidate algorithms (kernels/cublaslt.py) and the per-shape choice among them
(kernels/gemm_tuning.py) against F.linear in float32, at odd sizes, bf16 and fp16."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels import cublaslt, gemm_tuning, ops
from tests.kernels.triton_device import DTYPES

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
SHAPES = [(17, 1000, 520), (32, 4160, 4096), (2, 28800, 4096), (5, 77, 14336)]  # m, n, k


def data(m: int, n: int, k: int, dtype: torch.dtype, num_weights: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    ws = [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).cuda() for _ in range(num_weights)]
    return x, ws


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_every_candidate_matches_linear(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, (w,) = data(m, n, k, dtype)
    want = torch.nn.functional.linear(x.float(), w.float())
    algos = cublaslt.candidates(cublaslt.GemmShape(m, n, k, n, dtype), x.device.index)
    assert algos
    for algo in algos:
        y = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        cublaslt.matmul_into(y, x, w, algo)
        torch.testing.assert_close(y.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matmul_into_a_row_strided_output_writes_only_its_columns(dtype: torch.dtype) -> None:
    m, n, k = 9, 300, 264
    x, (w,) = data(m, n, k, dtype)
    wide = torch.zeros(m, n + 40, dtype=dtype, device="cuda")
    algo = cublaslt.candidates(cublaslt.GemmShape(m, n, k, n + 40, dtype), 0)[0]
    cublaslt.matmul_into(wide[:, :n], x, w, algo)
    torch.testing.assert_close(
        wide[:, :n].float(), torch.nn.functional.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2
    )
    assert not wide[:, n:].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_tuned_shape_dispatches_and_matches_linear(dtype: torch.dtype) -> None:
    gemm_tuning.reset()
    m, n, k = 32, 4160, 4096
    x, ws = data(m, n, k, dtype, num_weights=3)
    with gemm_tuning.recording() as gemms:
        for w in ws + ws[:1]:  # a weight seen twice counts once
            ops.linear(x, w)
    shape = cublaslt.GemmShape(m, n, k, n, dtype)
    assert list(gemms) == [shape] and len(gemms[shape]) == 3
    timings = gemm_tuning.tune(gemms)
    torch_us, chosen_us, _ = timings[shape]
    assert 0 < chosen_us <= torch_us
    assert gemm_tuning.tune(gemms) == {}  # chosen once
    for w in ws:
        torch.testing.assert_close(
            ops.linear(x, w).float(), torch.nn.functional.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2
        )
    graph = torch.cuda.CUDAGraph()  # the chosen algorithm captures like F.linear
    with torch.cuda.graph(graph):
        y = ops.linear(x, ws[0])
    x.normal_()
    graph.replay()
    torch.testing.assert_close(y.float(), torch.nn.functional.linear(x.float(), ws[0].float()), atol=2e-2, rtol=2e-2)
    gemm_tuning.reset()
