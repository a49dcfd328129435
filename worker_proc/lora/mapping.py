"""Which adapter slot each token of a forward pass uses, in the layout the kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Use the segment-grouped kernels when segments average at least this many tokens.
MIN_MEAN_SEGMENT_LEN = 2


@dataclass(frozen=True)
class LoraMapping:
    token_slots: torch.Tensor  # [num_tokens] int64 on the model's device, -1 = base model
    seg_starts: torch.Tensor  # [num_segments + 1] int64 on the CPU, token offsets of runs of one slot
    seg_slots: torch.Tensor  # [num_segments] int64 on the CPU
    use_segments: bool  # prefill-like batch: segment kernels; else per-token gather
    slots: tuple[int, ...]  # distinct adapter slots used (>= 0), host-side
    device_segments: tuple[torch.Tensor, torch.Tensor] | None = None  # seg_starts, seg_slots on the device
    max_seg_len: int = 0  # longest run of one slot
    in_graph: bool = False  # CUDA-graph capture: launch the kernels whatever the slots hold now
    # decode's grouped layout (kernels/lora_ref.py) on the device: order [num_tokens],
    # tile_starts [num_tiles + 1], tile_slots [num_tiles]; when set, it serves every LoRA op
    grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    num_slots: int = 0  # grouped: every used slot is below this; the stacked GEMM reads A of these (0: all)

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
        return LoraMapping(
            token_slots.long(),
            torch.tensor(starts, dtype=torch.long),
            torch.tensor(seg_slots, dtype=torch.long),
            len(slots) >= MIN_MEAN_SEGMENT_LEN * len(seg_slots),
            used,
            device_segments,
            max(b - a for a, b in zip(starts, starts[1:])),
        )


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
