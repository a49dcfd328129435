"""What a kernel needs to reach a buffer in symmetric memory on every rank (no Triton import: the
worker builds it on any machine, kernels/all_reduce_norm.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeerBuffers:
    """A symmetric-memory buffer in two halves, and the signal pads beside it, by address."""

    buffer: torch.Tensor  # [2 * half_numel]: this rank's buffer (held here, so it stays mapped)
    buffer_ptrs: torch.Tensor  # [world_size] int64: each rank's buffer, mapped in this process
    signal_pad_ptrs: torch.Tensor  # [world_size] int64: each rank's signal pad (uint32 flags, zero-filled)
    rank: int
    world_size: int
    dtype: torch.dtype  # of the buffer and of the rows it takes
    half_numel: int  # elements in each half of the buffer
    max_rows: int  # rows the signal pads hold flags for (one per row and rank)
