"""What a kernel needs to reach a buffer in symmetric memory on every rank (no Triton import: the
worker builds it on any machine, kernels/all_reduce_norm.py reads it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeerBuffers:
    """A symmetric-memory buffer of int64 packets in parts of equal size, by address on every rank,
    and this rank's epoch of each (part, row)."""

    buffer: torch.Tensor  # [num_parts * part_numel] int64: this rank's packets (held here, so it stays mapped)
    buffer_ptrs: torch.Tensor  # [world_size] int64: each rank's buffer, mapped in this process
    epochs: torch.Tensor  # [num_parts, max_rows] int32: the epoch each (part, row) last sent, zero-filled
    rank: int
    world_size: int
    dtype: torch.dtype  # of the rows it takes (16-bit)
    part_numel: int  # packets in each part of the buffer

    @property
    def max_rows(self) -> int:
        return self.epochs.shape[1]

    @property
    def num_parts(self) -> int:
        return self.epochs.shape[0]


@dataclass(frozen=True)
class RowSend:
    """Where a row-parallel projection's GEMV sends its one output row as packets, as each program
    finishes its columns, for the fused all-reduce norm that consumes the row (which then only awaits
    the peers' packets): the place of row 0 from this rank in part `part` of every peer's buffer."""

    peers: PeerBuffers
    part: int
    num_cols: int  # the row's columns (hidden); a stacked projection's shrink columns past them are not sent
