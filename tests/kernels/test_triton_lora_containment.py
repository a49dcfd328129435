"""GPU: the Triton LoRA kernels contain a hostile adapter slot, as the references do
(test_lora_containment_ref.py): with huge, infinite or NaN weights (or an infinite scaling) in one
slot and its own rows broken, every row of the other slots and of the base model comes out
bit-identical to a run where that slot holds zeros: shrink and expand in every layout (padded
tiles, split-K), the stacked expand, the norm and SiLU-and-mul that add a pending delta (B loaded
before the PDL wait or not), and the all-reduce fused into the norm, its packets included."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.hostile_slots import (
    HOSTILE_SLOTS,
    POISONS,
    Case,
    assert_contained,
    cases,
    lora_ops,
    norm_inputs,
    own_rows,
)
from tests.kernels.triton_device import DEVICE, DTYPES, requires_triton_device

pytest.importorskip("triton")

from ledgerserve.kernels import all_reduce_norm, fused, lora  # noqa: E402
from ledgerserve.kernels.fused import PREFETCH_B_ELEMS  # noqa: E402
from ledgerserve.kernels.lora_delta import rank_pad  # noqa: E402
from tests.kernels.test_triton_all_reduce_norm import PART_NUMEL, WORLD, packets, padded, row_h, two_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, requires_triton_device]
IN = 1315  # > K_PER_SPLIT: the shrink adds two split-K partials
OUTPUT_SIZES = {"single": [301], "qkv": [257, 67, 67], "gate_up": [190, 190]}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("sizes", sorted(OUTPUT_SIZES))
@pytest.mark.parametrize("op", ["segments", "tokens", "grouped", "stacked"])
def test_lora_kernels_leave_other_rows_bit_identical(
    op: str, sizes: str, poison: str, hostile: int, dtype: torch.dtype
) -> None:
    control, bad = cases(poison, hostile, OUTPUT_SIZES[sizes], IN, dtype, DEVICE)
    run = lora_ops(lora)[op]
    assert_contained(run(control), run(bad), bad, hostile)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("hidden", [1000, 5000], ids=["b-before-wait", "b-after-wait"])
def test_the_norm_adds_a_pending_delta_to_its_own_rows_only(
    hidden: int, poison: str, hostile: int, dtype: torch.dtype
) -> None:
    control, bad = cases(poison, hostile, [hidden], 64, dtype, DEVICE, seed=2)
    prefetch = rank_pad(control.delta()) * 2 ** (hidden - 1).bit_length() <= PREFETCH_B_ELEMS
    assert prefetch == (hidden == 1000)  # both of the kernel's ways to load B
    residual, weight = norm_inputs(control)

    def norm(case: Case) -> list[torch.Tensor]:
        return list(fused.fused_add_rms_norm(case.y, residual, weight, 1e-5, case.delta()))[::-1]

    assert_contained(norm(control), norm(bad), bad, hostile)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
def test_silu_and_mul_adds_a_pending_delta_to_its_own_rows_only(poison: str, hostile: int, dtype: torch.dtype) -> None:
    control, bad = cases(poison, hostile, [1500, 1500], 64, dtype, DEVICE, seed=3)  # two column blocks
    silu = [fused.silu_and_mul(case.y, case.delta()) for case in (control, bad)]
    assert_contained(silu[:1], silu[1:], bad, hostile)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
def test_the_all_reduce_norm_sends_and_sums_each_row_alone(poison: str, hostile: int, dtype: torch.dtype) -> None:
    """Rank 0 of two, the peer's packets in its buffer (tests/kernels/test_triton_all_reduce_norm.py):
    the peer's partial rows and h of the hostile slot's rows are broken as this rank's are."""
    control, bad = cases(poison, hostile, [1000], 64, dtype, DEVICE, seed=4)
    residual, weight = norm_inputs(control)
    outs = [_all_reduce_norm(case, residual, weight) for case in (control, bad)]
    assert_contained(*outs, bad, hostile)
    assert not torch.isfinite(outs[1][-1][own_rows(bad, hostile)]).all()


def _all_reduce_norm(case: Case, residual: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    """[packets this rank sent of each row, of its h, new residual, normed], each [num_tokens, ...]."""
    rank, peer, part, epoch = 0, 1, 1, 3
    num_tokens, hidden = case.y.shape
    delta = case.delta()
    peers, buffers = two_ranks(rank, case.y.dtype)
    peers.epochs[part, :num_tokens] = epoch - 1
    block, r_pad = 2 ** (hidden - 1).bit_length(), rank_pad(delta)

    def rows(buffer: torch.Tensor, src: int) -> torch.Tensor:  # [num_tokens, block // 2]
        return buffer[part * PART_NUMEL :][: num_tokens * WORLD * block // 2].view(num_tokens, WORLD, -1)[:, src]

    def hs(buffer: torch.Tensor, src: int) -> torch.Tensor:  # [num_tokens, r_pad // 2]
        area = buffer[part * PART_NUMEL + all_reduce_norm.h_area(PART_NUMEL) :][: num_tokens * WORLD * r_pad // 2]
        return area.view(num_tokens, WORLD, -1)[:, src]

    theirs = case.y.flip(1)  # the peer's partial rows: its hostile rows as broken as these
    rows(buffers[rank], peer)[:] = packets(padded(theirs, block), epoch)
    hs(buffers[rank], peer)[:] = packets(padded(row_h(delta), r_pad), epoch)  # what the peer's kernel sends
    assert all_reduce_norm.fits(peers, case.y, delta)
    normed, new_residual = all_reduce_norm.all_reduce_add_rms_norm(case.y, residual, weight, 1e-5, delta, peers, part)
    return [rows(buffers[peer], rank).clone(), hs(buffers[peer], rank).clone(), new_residual, normed]
