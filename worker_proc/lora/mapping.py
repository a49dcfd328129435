"""Which adapter slot each token of a forward pass uses, in every layout the kernels take
(kernels/lora_types.py); worker_proc/lora/layout.py picks the one a layer runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ledgerserve.kernels.lora_types import Segments, Tiles, Tokens


@dataclass(frozen=True)
class LoraMapping:
    tokens: Tokens  # each token's slot [num_tokens] int64 on the model's device; the distinct slots used
    segments: Segments  # runs of one slot, CPU tensors, with the longest run
    device_segments: Segments | None = None  # the same runs on the device, for the Triton segment kernels
    tiles: Tiles | None = None  # decode graphs: the grouped layout on the device
    num_slots: int = 0  # with tiles: every used slot is below this; the stacked GEMM reads A of these (0: all)

    @property
    def slots(self) -> tuple[int, ...]:
        """The distinct adapter slots used (>= 0), host-side."""
        return self.tokens.used or ()

    @staticmethod
    def from_slots(token_slots: torch.Tensor) -> LoraMapping | None:
        """From a tensor of slots (reads it back to the host: a sync on CUDA)."""
        return LoraMapping.from_host(token_slots.tolist(), token_slots)

    @staticmethod
    def from_host(
        slots: list[int], token_slots: torch.Tensor, device_segments: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> LoraMapping | None:
        """`slots` is the host copy of `token_slots` [num_tokens]; no device sync.
        `device_segments`: device copies of runs(slots), for the Triton segment kernels.
        None when no token uses an adapter (the forward pass skips LoRA entirely)."""
        used = tuple(sorted({slot for slot in slots if slot >= 0}))
        if not used:
            return None
        starts, seg_slots = runs(slots)
        max_len = max(b - a for a, b in zip(starts, starts[1:]))
        segments = Segments(torch.tensor(starts, dtype=torch.long), torch.tensor(seg_slots, dtype=torch.long), max_len)
        on_device = None if device_segments is None else Segments(*device_segments, max_len)
        return LoraMapping(Tokens(token_slots.long(), used), segments, on_device)

    @staticmethod
    def for_graph(token_slots: torch.Tensor, tiles: Tiles, num_slots: int) -> LoraMapping:
        """A decode graph's: its slots and tiles are graph inputs, so the slots used are unknown
        at capture; the stacked GEMM reads the A of slots [0, num_slots)."""
        empty = torch.zeros(0, dtype=torch.long)
        return LoraMapping(Tokens(token_slots, ()), Segments(empty, empty, 0), tiles=tiles, num_slots=num_slots)

    @property
    def num_tokens(self) -> int:
        return self.tokens.slots.shape[0]


def runs(slots: list[int]) -> tuple[list[int], list[int]]:
    """Token offsets [num_segments + 1] and slot [num_segments] of each run of equal slots."""
    starts: list[int] = []
    seg_slots: list[int] = []
    for i, slot in enumerate(slots):
        if i == 0 or slot != slots[i - 1]:
            starts.append(i)
            seg_slots.append(slot)
    starts.append(len(slots))
    return starts, seg_slots
