"""The one place that decides how a layer adds its LoRA delta; the layers, the manager and the
decode graphs follow it.

- Which layers keep A stacked under the base weight (`stacks_a`), so that a decode step's one
  GEMM returns the base output and every slot's shrink.
- Which kernels a layer runs for a batch (`choose`): in the decode graphs, the grouped tiles
  (the stacked expand on a stacked layer); elsewhere the segment kernels for prefill-like
  batches, the per-token kernels otherwise; nothing when no slot of the batch targets it.
- Which slot counts get their own LoRA decode graphs (`slot_buckets`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ledgerserve.kernels import ops
from ledgerserve.kernels.lora_types import LoraLayout, SlotWeights, Tiles
from ledgerserve.worker_proc.lora.mapping import LoraMapping

MIN_MEAN_SEGMENT_LEN = 2  # segment kernels when the runs of one slot average at least this many tokens
SLOT_BUCKETS = (4, 16)  # LoRA graphs per number of leading slots, besides max_loras itself
UNSTACKED = ("lm_head",)  # it may share the embedding table, which must keep its own storage


@dataclass(frozen=True)
class Stacked:
    """Decode on a stacked layer: one GEMM over the base weight and the A of slots [0, num_slots),
    then the grouped expand over `tiles` (or the consuming kernel adds it: kernels/lora_types.LoraDelta)."""

    tiles: Tiles
    num_slots: int  # 0: every slot
    token_slots: torch.Tensor  # [num_tokens] int64, -1 = base


def stacks_a(module_name: str) -> bool:
    """Whether the layer at this module path keeps every slot's A under its base weight."""
    return module_name not in UNSTACKED


def slot_buckets(max_loras: int) -> list[int]:
    """Slot counts that get their own LoRA graphs: SLOT_BUCKETS capped at max_loras, and max_loras."""
    return sorted({min(n, max_loras) for n in SLOT_BUCKETS} | {max_loras})


def choose(weights: SlotWeights, stacked: bool, mapping: LoraMapping, x: torch.Tensor) -> Stacked | LoraLayout | None:
    """How a layer (A under its base weight if `stacked`) adds the LoRA delta of `mapping`'s
    tokens to its output for input x [num_tokens, in]; None: it adds nothing."""
    if mapping.tiles is not None:  # a decode graph: launch whatever the slots hold now
        return Stacked(mapping.tiles, mapping.num_slots, mapping.tokens.slots) if stacked else mapping.tiles
    if weights.batch_rank(mapping.slots) == 0:
        return None
    if mapping.num_tokens >= MIN_MEAN_SEGMENT_LEN * mapping.segments.slots.shape[0]:  # prefill-like
        segments = mapping.device_segments if ops.use_triton_lora(x) else mapping.segments
        if segments is not None:
            return segments
    return mapping.tokens
