"""Step inputs for CUDA: one pinned host buffer, one non-blocking copy per step.

Every int list a forward pass needs (token ids, positions, slots, block tables, ...) is
packed into one int64 row of a reusable pinned buffer, copied to the device with
`non_blocking=True`, and split there into views. Nothing here waits on the GPU, except
that the buffer is not rewritten before the previous step's copy out of it finished.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from dataclasses import dataclass

import torch

from ledgerserve.kernels.attention_ref import PagedAttentionMetadata

# int64 elements per 16 bytes: every view handed out starts 16-byte aligned, as Triton compiles a
# kernel apart for pointers that are and aren't, so a batch's layout never costs a new compile
ALIGN = 2


@dataclass(frozen=True)
class DeviceAttentionMetadata(PagedAttentionMetadata):
    """The host lists of PagedAttentionMetadata plus their device copies for the Triton kernels."""

    block_table_t: torch.Tensor  # [num_reqs, max_blocks] int32, padded with block 0 (never read)
    seq_lens_t: torch.Tensor  # [num_reqs] int32
    query_start_loc_t: torch.Tensor  # [num_reqs + 1] int32
    max_query_len: int

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1


class PinnedStaging:
    """A growable pinned int64 buffer reused every step."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.empty(0, dtype=torch.long)
        self.host_bytes = _writable_bytes(self.host)  # the same memory, for struct.pack_into
        self.copied = torch.cuda.Event()  # recorded after each copy out of `host`

    def _pack(self, parts: list[list[int]]) -> torch.Tensor:
        """`parts` concatenated into the pinned buffer, once the last copy out of it finished: [total]."""
        flat: list[int] = []
        for part in parts:
            flat += part
        total = len(flat)
        self.copied.synchronize()  # the last step's copy out of `host` is done (it always is by now)
        if self.host.numel() < total:
            self.host = torch.empty(max(total, 2 * self.host.numel()), dtype=torch.long, pin_memory=True)
            self.host_bytes = _writable_bytes(self.host)
        struct.pack_into(f"={total}q", self.host_bytes, 0, *flat)  # no torch op, no per-int objects in torch
        return self.host[:total]

    def upload(self, parts: list[list[int]]) -> list[torch.Tensor]:
        """Device int64 views, one per list in `parts`, from a single H2D copy; each starts 16-byte aligned."""
        dev = self._pack([_padded(p) for p in parts]).to(self.device, non_blocking=True)  # [total]
        self.copied.record()
        return _views(dev, parts)

    def upload_into(
        self, dst: torch.Tensor, parts: list[list[int]], extra: list[list[int]] | None = None
    ) -> list[torch.Tensor]:
        """One H2D copy of `parts`, concatenated, into the device int64 tensor `dst` (as many elements);
        the lists in `extra`, if any, follow from the same pinned buffer in a second copy, as device views."""
        extra = extra or []
        num_parts = sum(len(p) for p in parts)
        first = num_parts + -num_parts % ALIGN  # the extras start aligned
        host = self._pack(parts + [[0] * (first - num_parts)] + [_padded(p) for p in extra])
        assert dst.dtype == torch.long and dst.is_contiguous() and dst.numel() == num_parts
        dst.copy_(host[:num_parts], non_blocking=True)
        views = _views(host[first:].to(self.device, non_blocking=True), extra) if extra else []
        self.copied.record()
        return views


def _padded(part: list[int]) -> list[int]:
    """`part` padded with zeros to a whole number of ALIGN elements."""
    return part + [0] * (-len(part) % ALIGN)


def _views(dev: torch.Tensor, parts: list[list[int]]) -> list[torch.Tensor]:
    """`dev` [sum of padded lengths] split back into one view per part, padding dropped."""
    return [view[: len(p)] for view, p in zip(dev.split([len(_padded(p)) for p in parts]), parts)]


def _writable_bytes(t: torch.Tensor) -> ctypes.Array:
    """A writable byte buffer over a contiguous CPU tensor's memory (kept alive by the caller's tensor)."""
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def padded_tables(tables: list[list[int]]) -> tuple[list[int], int]:
    """Flat [num_reqs * max_blocks] block ids, each row padded with 0, and max_blocks."""
    width = max((len(t) for t in tables), default=1) or 1
    return [b for t in tables for b in itertools.chain(t, itertools.repeat(0, width - len(t)))], width
