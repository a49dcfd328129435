"""GPU: the sampler's Triton row argmax (kernels/argmax.py) against torch.argmax, on ragged
vocabularies, ties across and within chunks, and rows masked with -inf."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_device import DEVICE, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import argmax, ops  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]


@pytest.mark.parametrize("num_rows,n_cols", [(1, 128256), (32, 128256), (3, 151936), (5, 4096), (2, 4097), (7, 13)])
def test_argmax_matches_torch(num_rows: int, n_cols: int) -> None:
    x = torch.randn(num_rows, n_cols, generator=torch.Generator().manual_seed(n_cols + num_rows)).to(DEVICE)
    torch.testing.assert_close(argmax.argmax(x), x.argmax(dim=-1))


def test_ties_take_the_first_index_across_and_within_chunks() -> None:
    x = torch.zeros(3, 3 * argmax.CHUNK + 5, device=DEVICE)
    x[0, [argmax.CHUNK + 7, 2 * argmax.CHUNK + 1, 5]] = 4.0  # the earliest one sits in chunk 0
    x[1, [2 * argmax.CHUNK + 9, 2 * argmax.CHUNK + 3]] = 1.0  # two in the same chunk
    # row 2: all zeros, the first column wins
    assert argmax.argmax(x).tolist() == [5, 2 * argmax.CHUNK + 3, 0]


def test_masked_rows_and_strided_rows() -> None:
    base = torch.randn(4, 2 * argmax.CHUNK + 100, device=DEVICE)
    x = base[:, : argmax.CHUNK + 50]  # row stride past the row's end, as a logits slice
    x[1, :] = float("-inf")
    x[1, argmax.CHUNK + 3] = -1e30
    x[2, : argmax.CHUNK] = float("-inf")
    got = ops.argmax(x)
    torch.testing.assert_close(got, x.argmax(dim=-1))
    assert got[1].item() == argmax.CHUNK + 3


def test_nan_counts_above_every_number_as_in_torch() -> None:
    """A row of an adapter's NaN logits still samples an id inside the vocabulary (its first NaN),
    as torch's argmax picks it, and the other rows are unchanged."""
    n_cols = 3 * argmax.CHUNK + 5
    x = torch.randn(6, n_cols, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    clean = argmax.argmax(x.clone())
    x[1] = float("nan")  # every chunk NaN
    x[2, argmax.CHUNK + 9 :] = float("nan")  # from the middle of chunk 1 on
    x[3, [2 * argmax.CHUNK + 4, 17]] = float("nan")  # two, in different chunks
    x[4] = float("-inf")
    x[4, n_cols - 1] = float("nan")  # the last column of the ragged last chunk
    x[5, 7] = float("inf")
    got = argmax.argmax(x)
    torch.testing.assert_close(got, x.argmax(dim=-1))
    assert got.tolist()[1:] == [0, argmax.CHUNK + 9, 17, n_cols - 1, 7]
    assert got[0] == clean[0] and bool((0 <= got).all() and (got < n_cols).all())
