"""Which adapter slot each token of a forward pass uses, in the layout the kernels take."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Use the segment-grouped kernels when segments average at least this many tokens.
MIN_MEAN_SEGMENT_LEN = 2


@dataclass(frozen=True)
class LoraMapping:
    token_slots: torch.Tensor  # [num_tokens] int64, -1 = base model
    seg_starts: torch.Tensor  # [num_segments + 1] int64, token offsets of runs of one slot
    seg_slots: torch.Tensor  # [num_segments] int64
    use_segments: bool  # prefill-like batch: segment kernels; else per-token gather

    @staticmethod
    def from_slots(token_slots: torch.Tensor) -> "LoraMapping | None":
        """None when no token uses an adapter (the forward pass skips LoRA entirely)."""
        slots: list[int] = token_slots.tolist()
        if all(slot < 0 for slot in slots):
            return None
        starts, seg_slots = _runs(slots)
        num_tokens, num_segments = len(slots), len(seg_slots)
        device = token_slots.device
        return LoraMapping(
            token_slots.long(),
            torch.tensor(starts, dtype=torch.long, device=device),
            torch.tensor(seg_slots, dtype=torch.long, device=device),
            num_tokens >= MIN_MEAN_SEGMENT_LEN * num_segments,
        )


def _runs(slots: list[int]) -> tuple[list[int], list[int]]:
    """Token offsets [num_segments + 1] and slot [num_segments] of each run of equal slots."""
    starts: list[int] = []
    seg_slots: list[int] = []
    for i, slot in enumerate(slots):
        if i == 0 or slot != slots[i - 1]:
            starts.append(i)
            seg_slots.append(slot)
    starts.append(len(slots))
    return starts, seg_slots
