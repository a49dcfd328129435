"""GPU: the batch-1 Triton GEMV (kernels/gemv.py) against F.linear in float32, every shape class
of its config table and odd sizes, with and without bias, on a row-strided weight view."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_device import DEVICE, DTYPES, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import gemv, ops  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
SHAPES = [(6144 + 192, 4096), (4096, 4096), (28672 + 128, 4096), (4096, 14336), (1000, 1000 + 8), (37, 513)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(dtype: torch.dtype, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    stacked = (torch.randn(n + 5, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    weight = stacked[:n]  # the top rows of a stacked weight, as SlotLinear passes it
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    bias = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    got = gemv.gemv(x, weight, bias)
    want = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.shape == (1, n) and got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.linear(x, weight, bias), got)  # one row dispatches to the GEMV


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_keeps_cublas_for_several_rows(dtype: torch.dtype) -> None:
    x = torch.randn(3, 64, dtype=dtype, device=DEVICE)
    w = torch.randn(32, 64, dtype=dtype, device=DEVICE)
    torch.testing.assert_close(ops.linear(x, w), torch.nn.functional.linear(x, w))
