"""One hostile adapter slot beside others, for the LoRA containment tests of the torch references
and the Triton kernels: every slot holds random weights but the hostile one, whose A and B (within
its rank) hold huge finite, infinite or NaN values, or whose scaling is infinite, and whose own
token rows of x and y are broken too (an earlier layer it already broke). The control holds zeros
in that slot, and the same rows unbroken. Every row of the other slots and of the base model
(slot -1) must come out of each op bit-identical in both."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from ledgerserve.kernels.lora_types import (
    GROUP_TILE,
    LoraDelta,
    Segments,
    SlotWeights,
    Tiles,
    Tokens,
    group_tiles,
    max_tiles,
)
from ledgerserve.worker_proc.lora.mapping import runs

MAX_LORAS, MAX_RANK = 5, 13
POISONS = ("huge", "inf", "nan", "inf-scaling")
HOSTILE_SLOTS = (0, 2)  # 0: what a base token's clamped slot index points at
HUGE = {torch.float64: 1e300, torch.float32: 1e38, torch.bfloat16: 1e38, torch.float16: 6e4}  # finite in each


def token_slots(hostile: int) -> list[int]:
    """Runs of the hostile slot (one longer than a tile: two tiles, one ragged) among base tokens,
    slots that target every slice, slot 1 (none of slice 0) and slot 3 (nothing)."""
    other = 2 if hostile == 0 else 0
    h = hostile
    return [h] * 3 + [-1] * 2 + [1, h, 4, 4, 4, -1, 3, other, other, h] + [h] * (GROUP_TILE + 1) + [1] * 5 + [-1, other]


@dataclass(frozen=True)
class Case:
    """One side of a comparison: the slots' weights and the inputs, on the device."""

    weights: SlotWeights
    x: torch.Tensor  # [num_tokens, in]
    y: torch.Tensor  # [num_tokens, sum(output_sizes)]
    slots: list[int]

    @property
    def h(self) -> torch.Tensor:  # [num_tokens, max_loras, num_slices, max_rank]: every slot's shrink, one GEMM
        h = torch.einsum("ti,lsri->tlsr", self.x.double(), self.weights.a.double())
        return h.to(self.x.dtype)

    @property
    def token_slots(self) -> torch.Tensor:
        return torch.tensor(self.slots, device=self.x.device)

    def delta(self) -> LoraDelta:
        return LoraDelta(self.h, self.weights, self.token_slots)


def cases(
    poison: str, hostile: int, output_sizes: list[int], in_features: int, dtype: torch.dtype, device: str, seed: int = 0
) -> tuple[Case, Case]:
    """(control, hostile): the same weights and inputs, but for the hostile slot and its own rows."""
    gen = torch.Generator().manual_seed(seed)
    num_slices, max_out = len(output_sizes), max(output_sizes)
    slots = token_slots(hostile)
    ranks = torch.randint(1, MAX_RANK + 1, (MAX_LORAS, num_slices), generator=gen)
    ranks[1, 0] = 0  # slot 1 does not target slice 0
    ranks[3] = 0  # slot 3 targets nothing
    past = torch.arange(MAX_RANK) >= ranks[..., None]  # [max_loras, num_slices, max_rank]: zero there, as stored
    a = (torch.randn(MAX_LORAS, num_slices, MAX_RANK, in_features, generator=gen) * in_features**-0.5).to(dtype)
    b_t = torch.randn(MAX_LORAS, num_slices, MAX_RANK, max_out, generator=gen).to(dtype)  # B^T: B stored out-major
    a, b_t = a.masked_fill(past[..., None], 0.0), b_t.masked_fill(past[..., None], 0.0)
    scalings = torch.rand(MAX_LORAS, num_slices, generator=gen) * 2
    x = torch.randn(len(slots), in_features, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(output_sizes), generator=gen).to(dtype)
    own = (torch.tensor(slots) == hostile)[:, None]  # [num_tokens, 1]: the hostile slot's rows

    def side(a: torch.Tensor, b_t: torch.Tensor, scalings: torch.Tensor, rows: float | None) -> Case:
        xs, ys = (t if rows is None else t.masked_fill(own, rows) for t in (x, y))
        b = b_t.to(device).transpose(2, 3)  # [max_loras, num_slices, max_out, max_rank]
        weights = SlotWeights.of(a.to(device), b, ranks.to(device), scalings.to(device), output_sizes)
        return Case(weights, xs.to(device), ys.to(device), slots)

    zeroed = [t.clone().index_fill_(0, torch.tensor(hostile), 0.0) for t in (a, b_t)]
    return side(*zeroed, scalings, None), side(*_poisoned(poison, hostile, a, b_t, scalings, past, dtype))


def _poisoned(
    poison: str,
    hostile: int,
    a: torch.Tensor,
    b_t: torch.Tensor,
    scalings: torch.Tensor,
    past: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """The hostile slot's A, B^T and scalings (within its rank), and the value of its own x and y rows."""
    a, b_t, scalings = a.clone(), b_t.clone(), scalings.clone()
    value = {"huge": HUGE[dtype], "inf": float("inf"), "nan": float("nan")}.get(poison)
    if value is None:  # an infinite scaling, the weights as they were
        scalings[hostile] = float("inf")
        return a, b_t, scalings, float("inf")
    within = ~past[hostile][..., None]  # [num_slices, max_rank, 1]
    a[hostile] = torch.where(within, torch.full_like(a[hostile], value), a[hostile])
    b_t[hostile] = torch.where(within, torch.full_like(b_t[hostile], -value), b_t[hostile])
    return a, b_t, scalings, value


Op = Callable[["Case"], list[torch.Tensor]]  # what one op computes of a case: its outputs, first dim the tokens


def other_rows(case: Case, hostile: int) -> torch.Tensor:
    """Indices of the rows not on the hostile slot (base rows and the other slots')."""
    return torch.tensor([i for i, s in enumerate(case.slots) if s != hostile], device=case.x.device)


def own_rows(case: Case, hostile: int) -> torch.Tensor:
    return torch.tensor([i for i, s in enumerate(case.slots) if s == hostile], device=case.x.device)


def layouts(case: Case) -> dict[str, Segments | Tokens | Tiles]:
    """The batch's slots in every layout the LoRA kernels take, on the case's device."""
    device = case.x.device
    starts, seg_slots = runs(case.slots)
    max_len = max(end - start for start, end in zip(starts, starts[1:]))
    order, tile_starts, tile_slots = group_tiles(case.slots, max_tiles(len(case.slots), MAX_LORAS))
    return {
        "segments": Segments(_on(starts, device), _on(seg_slots, device), max_len),
        "tokens": Tokens(_on(case.slots, device)),
        "grouped": Tiles(_on(order, device), _on(tile_starts, device), _on(tile_slots, device)),
    }


def _on(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def lora_ops(impl: ModuleType) -> dict[str, Op]:
    """What the LoRA ops of `impl` (kernels.lora_ref or kernels.lora) compute of a case: shrink then
    expand in each layout, and the stacked expand (from every slot's shrink, as one GEMM gives it)."""
    ops: dict[str, Op] = {name: _shrink_expand(impl, name) for name in ("segments", "tokens", "grouped")}

    def stacked(case: Case) -> list[torch.Tensor]:
        y = case.y.clone()
        impl.lora_expand_stacked(y, case.h, case.weights, layouts(case)["grouped"])
        return [y]

    ops["stacked"] = stacked
    return ops


def _shrink_expand(impl: ModuleType, name: str) -> Op:
    def op(case: Case) -> list[torch.Tensor]:
        layout = layouts(case)[name]
        buf = getattr(impl, f"lora_shrink_{name}")(case.x, case.weights, layout)  # [num_slices, num_tokens, rank]
        y = case.y.clone()
        getattr(impl, f"lora_expand_{name}")(y, buf, case.weights, layout)
        return [buf.transpose(0, 1), y]

    return op


def norm_inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual [num_tokens, hidden] and a norm weight [hidden] for a case's y, the same for both sides."""
    gen = torch.Generator().manual_seed(99)
    num_tokens, hidden = case.y.shape
    residual = torch.randn(num_tokens, hidden, generator=gen).to(case.y.dtype).to(case.y.device)
    return residual, torch.rand(hidden, generator=gen).to(case.y.dtype).to(case.y.device) + 0.5


def assert_contained(control: list[torch.Tensor], hostile: list[torch.Tensor], case: Case, slot: int) -> None:
    """Every output row not on `slot` is bit-identical; the hostile slot's own rows did break."""
    others, own = other_rows(case, slot), own_rows(case, slot)
    for i, (want, got) in enumerate(zip(control, hostile)):
        assert torch.isfinite(want[others]).all(), f"output {i}: the control is not finite"
        bad = (_bits(want[others]) != _bits(got[others])).flatten(1).any(1)
        assert not bad.any(), f"output {i}: rows {others[bad].tolist()} changed (slots {case.slots})"
    assert not torch.isfinite(hostile[-1][own]).all(), "the hostile slot's rows came out finite: no poison"


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of a float tensor, as integers of its width (so -0.0 differs from 0.0)."""
    return t.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
