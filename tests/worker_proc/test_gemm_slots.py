"""The stacked GEMM's slot count: candidates, the choice among timings (a fake timer stands in
for CUDA events), and that reading more slots' A than a bucket needs changes no output."""

from __future__ import annotations

import torch

from kernels.lora_ref import group_tiles, max_tiles
from worker_proc import gemm_slots
from worker_proc.lora.mapping import LoraMapping
from worker_proc.models.layers import SlotLinear


def _stacked(max_loras: int, seed: int = 0) -> SlotLinear:
    gen = torch.Generator().manual_seed(seed)
    lin = SlotLinear(6, [5, 3], bias=False).double()
    lin.weight.data.copy_(torch.randn(8, 6, generator=gen, dtype=torch.float64))
    weights = lin.attach_lora(max_loras=max_loras, max_rank=4, stack=True)
    for slot in range(max_loras):
        a = torch.randn(3, 6, generator=gen, dtype=torch.float64)
        b = torch.randn(5, 3, generator=gen, dtype=torch.float64)
        weights.load_slot(slot, [(a, b, 1.5), None])
    return lin


def test_candidates_double_up_to_max_loras() -> None:
    assert gemm_slots.candidates(4, 32) == [4, 8, 16, 32]
    assert gemm_slots.candidates(16, 32) == [16, 32]
    assert gemm_slots.candidates(4, 6) == [4, 6]
    assert gemm_slots.candidates(32, 32) == [32]


def test_fastest_prefers_fewer_slots_within_two_percent() -> None:
    assert gemm_slots.fastest({4: 13.3, 8: 13.0, 16: 12.2, 32: 12.25}) == 16
    assert gemm_slots.fastest({4: 10.1, 8: 10.0, 16: 12.0}) == 4
    assert gemm_slots.fastest({16: 5.0}) == 16


def test_tune_times_every_candidate_and_sets_each_layer() -> None:
    layers = [_stacked(8, seed) for seed in range(3)]
    seen: list[tuple[int, int]] = []
    cost = {2: 3.0, 4: 2.0, 8: 2.5}

    def fake_time(x: torch.Tensor, num_read: int) -> float:
        seen.append((x.shape[0], num_read))
        return cost[num_read] * (1 + x.shape[0] / 100)

    choice = gemm_slots.tune(layers, [1, 32], [2, 8], fake_time)
    assert choice == {(1, 2): 4, (32, 2): 4, (1, 8): 8, (32, 8): 8}
    assert all(layer.gemm_slots == choice for layer in layers)
    assert sorted(set(seen)) == [(1, 2), (1, 4), (1, 8), (32, 2), (32, 4), (32, 8)]  # bucket 8 alone: not timed
    assert len(seen) == 2 * 3 * gemm_slots.NUM_REPS
    assert gemm_slots.projection_classes(torch.nn.ModuleList(layers)) == [layers]


def test_reading_more_slots_changes_no_output() -> None:
    lin = _stacked(8)
    slots = [1, -1, 0, 1, 1, 0]
    x = torch.randn(len(slots), 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    grouped = tuple(torch.tensor(t) for t in group_tiles(slots, max_tiles(len(slots), 2)))
    mapping = LoraMapping(torch.tensor(slots), torch.zeros(0), torch.zeros(0), False, (), grouped=grouped, num_slots=2)
    exact, (y_exact, delta_exact) = lin(x, mapping), lin.forward_deferred(x, mapping)
    lin.gemm_slots = {(len(slots), 2): 8}
    wide, (y_wide, delta_wide) = lin(x, mapping), lin.forward_deferred(x, mapping)
    assert delta_exact is not None and delta_wide is not None
    assert delta_exact.h.shape[1] == 2 and delta_wide.h.shape[1] == 8
    torch.testing.assert_close(wide, exact)
    torch.testing.assert_close(y_wide, y_exact)
    torch.testing.assert_close(delta_wide.h[:, :2], delta_exact.h)
    torch.testing.assert_close(wide, lin(x, LoraMapping.from_slots(torch.tensor(slots))))  # the per-segment path
