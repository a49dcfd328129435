"""The torch reference LoRA ops contain a hostile adapter slot: with huge, infinite or NaN weights
(or an infinite scaling) in one slot and its own rows broken, every row of the other slots and of
the base model comes out bit-identical to a run where that slot holds zeros, in every layout, the
stacked expand and the fused ops that add a pending delta (tests/kernels/hostile_slots.py)."""

from __future__ import annotations

import pytest
import torch

from ledgerserve.kernels import lora_ref, ops
from ledgerserve.kernels.fused_ref import fused_add_rms_norm_ref, silu_and_mul_ref
from tests.kernels.hostile_slots import (
    HOSTILE_SLOTS,
    POISONS,
    Case,
    assert_contained,
    cases,
    layouts,
    lora_ops,
    norm_inputs,
)

OUTPUT_SIZES = {"single": [29], "qkv": [23, 11, 11], "gate_up": [19, 19]}
IN = 37
DTYPE = torch.float32  # the CPU model's


@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("sizes", sorted(OUTPUT_SIZES))
@pytest.mark.parametrize("op", ["segments", "tokens", "grouped", "stacked"])
def test_lora_ops_leave_other_rows_bit_identical(op: str, sizes: str, poison: str, hostile: int) -> None:
    control, bad = cases(poison, hostile, OUTPUT_SIZES[sizes], IN, DTYPE, "cpu")
    run = lora_ops(lora_ref)[op]
    assert_contained(run(control), run(bad), bad, hostile)


@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
def test_the_dispatching_ops_leave_other_rows_bit_identical(poison: str, hostile: int) -> None:
    """kernels/ops.py, as the model calls it on the CPU, per layout."""
    control, bad = cases(poison, hostile, OUTPUT_SIZES["qkv"], IN, DTYPE, "cpu", seed=1)

    def run(case: Case) -> list[torch.Tensor]:
        outs = []
        for layout in layouts(case).values():
            y = case.y.clone()
            ops.lora_expand(y, ops.lora_shrink(case.x, case.weights, layout), case.weights, layout)
            outs.append(y)
        return outs

    assert_contained(run(control), run(bad), bad, hostile)


@pytest.mark.parametrize("hostile", HOSTILE_SLOTS)
@pytest.mark.parametrize("poison", POISONS)
def test_a_pending_delta_reaches_only_its_own_rows(poison: str, hostile: int) -> None:
    """The residual-add norm and SiLU-and-mul that add a projection's pending delta (h of every slot
    for every row, from one GEMM: a base row's h of the hostile slot is broken too)."""
    hidden, d = 29, 19
    control, bad = cases(poison, hostile, [hidden], IN, DTYPE, "cpu", seed=2)
    residual, weight = norm_inputs(control)

    def norm(case: Case) -> list[torch.Tensor]:
        return list(fused_add_rms_norm_ref(case.y, residual, weight, 1e-5, case.delta()))[::-1]

    assert_contained(norm(control), norm(bad), bad, hostile)
    control, bad = cases(poison, hostile, [d, d], IN, DTYPE, "cpu", seed=3)
    silu = [silu_and_mul_ref(case.y, case.delta()) for case in (control, bad)]
    assert_contained(silu[:1], silu[1:], bad, hostile)
