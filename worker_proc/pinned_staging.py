"""A growable pinned int64 buffer that puts a step's int lists on the device in one non-blocking
copy (worker_proc/step_inputs.py), rewritten only once the previous copy out of it finished."""

from __future__ import annotations

import ctypes
import struct

import torch

# int64 elements per 16 bytes: every view handed out starts 16-byte aligned, as Triton compiles a
# kernel apart for pointers that are and aren't, so a batch's layout never costs a new compile
ALIGN = 2


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
