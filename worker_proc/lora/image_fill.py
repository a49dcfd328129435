"""Filling a slot image from an adapter file's data section (worker_proc/lora/slot_image.py),
while that section is being read.

Every tensor is converted into its piece in the model dtype, B transposed into B^T (in
blocks of TRANSPOSE_COLS columns, which torch copies several times faster than a plain 2-D
transpose), as soon as its bytes have arrived; then B^T's padding columns and the alignment
gaps are zeroed and the pieces checked finite (exponent bits, in bounded chunks). Copies and
checks run on a few threads in balanced groups; torch releases the GIL in each.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from shared.adapter_types import AdapterError
from shared.safetensors_header import Header
from worker_proc.lora.slot_image import ImageBytes, ImageLayout, SlotLayout

NUM_FILL_THREADS = 4
TRANSPOSE_COLS = 64
CHECK_CHUNK_BYTES = 4 << 20  # the finiteness check's temporaries stay this small
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# model dtype -> (its bits as an int, the exponent mask): all exponent bits set is inf or NaN
EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                 torch.float16: (torch.int16, 0x7C00)}
_pool = ThreadPoolExecutor(NUM_FILL_THREADS, "adapter-fill")


@dataclass(frozen=True)
class Copy:
    end: int  # the source tensor's last byte + 1 in the data section
    dst: torch.Tensor  # [rank, cols]
    key: str  # the source tensor
    shape: tuple[int, int]  # its [rows, cols] in the file
    transpose: bool  # B: the source's transpose goes to dst


class ImageFiller:
    """Fills an image while the file's data section (`data`, [n] uint8) is being read: the
    copies whose source bytes have arrived run on the fill threads meanwhile. `finish` waits
    for them, zeroes padding and gaps, and checks the pieces are finite (AdapterError). Call
    `wait` before the data buffer or the image is reused, whatever happened."""

    def __init__(self, image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout, header: Header,
                 data: torch.Tensor) -> None:
        self.image, self.layout, self.slot_layout, self.header, self.data = image, layout, slot_layout, header, data
        _write_tables(image, layout)
        self.pads: list[torch.Tensor] = []  # B^T's columns past the slice's outputs
        self.split: list[tuple[int, torch.Tensor]] = []  # (offset, temporary) of pieces across two extents
        self.copies = sorted(self._plan(), key=lambda c: c.end)
        self.num_started = 0
        self.futures: list = []

    def arrived(self, num_bytes: int) -> None:
        """Bytes [0, num_bytes) of the data section are in: start the copies they complete."""
        ready = []
        while self.num_started < len(self.copies) and self.copies[self.num_started].end <= num_bytes:
            ready.append(self.copies[self.num_started])
            self.num_started += 1
        for group in _balanced(ready, lambda c: c.dst.numel()):
            self.futures.append(_pool.submit(self._copy_group, group))

    def finish(self) -> None:
        self.arrived(self.data.numel())
        self.wait()
        if self.pads:
            torch._foreach_zero_(self.pads)
        for offset, tmp in self.split:
            self.image.write(offset, tmp.view(-1).view(torch.uint8))
        _zero_gaps(self.image, self.layout, self.slot_layout)
        if not self.layout.pieces:
            return
        views = self.image.ranges(self.layout.pieces[0].a_offset, self.layout.num_bytes)
        groups = _balanced([c for v in views for c in v.split(CHECK_CHUNK_BYTES)], torch.Tensor.numel)
        if not all(_pool.map(lambda group: _all_finite(group, self.layout.dtype), groups)):
            raise AdapterError("the adapter's weights hold NaN or infinite values (in the model's dtype).")

    def abandon(self) -> None:
        """Wait for every copy started, ignoring failures (the load fails for another reason)."""
        for future in self.futures:
            future.exception()
        self.futures = []

    def wait(self) -> None:
        """Wait for every copy started; re-raise the first failure."""
        futures, self.futures = self.futures, []
        errors = [f.exception() for f in futures]  # waits for all of them
        for error in errors:
            if error is not None:
                raise error

    def _plan(self) -> list[Copy]:
        copies = []
        dtype = self.layout.dtype
        for p in self.layout.pieces:
            spec = self.slot_layout.slices[p.slice]
            dst_a = _piece(self.image, p.a_offset, p.rank, spec.in_features, dtype, self.split)
            copies.append(Copy(self.header.tensors[p.a_key].stop, dst_a, p.a_key, (p.rank, spec.in_features), False))
            dst_b = _piece(self.image, p.b_offset, p.rank, spec.max_out, dtype, self.split)  # [rank, max_out]
            copies.append(Copy(self.header.tensors[p.b_key].stop, dst_b[:, : spec.out_features], p.b_key,
                               (spec.out_features, p.rank), True))
            if spec.max_out > spec.out_features:
                self.pads.append(dst_b[:, spec.out_features :])
        return copies

    def _copy_group(self, group: list[Copy]) -> None:
        dsts, srcs = [], []
        for c in group:
            src = _file_tensor(self.data, self.header, c.key).view(c.shape)
            dst, src = _transposing(c.dst, src) if c.transpose else (c.dst, src)
            dsts.append(dst)
            srcs.append(src)
        torch._foreach_copy_(dsts, srcs)


def _write_tables(image: ImageBytes, layout: ImageLayout) -> None:
    """Every slice's rank (int64) and scaling (float32) at the image's start."""
    n = layout.num_slices
    meta = image.region(0, 12 * n)
    assert meta is not None  # the table is smaller than any page
    meta[: 8 * n].view(torch.int64).copy_(torch.tensor(layout.ranks, dtype=torch.int64))
    meta[8 * n :].view(torch.float32).copy_(torch.tensor(layout.scalings, dtype=torch.float32))


def _transposing(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views copying src [out, rank] into dst [rank, out] as its transpose, in column blocks."""
    out, rank = src.shape
    if out % TRANSPOSE_COLS:
        return dst, src.t()
    blocks = out // TRANSPOSE_COLS
    # dst [rank, blocks, cols] <- src [blocks, cols, rank] permuted
    return dst.view(rank, blocks, TRANSPOSE_COLS), src.view(blocks, TRANSPOSE_COLS, rank).permute(2, 0, 1)


def _balanced(items: list, size: Callable) -> list[list]:
    """`items` in NUM_FILL_THREADS groups of about equal total size (largest first, to the lightest)."""
    groups: list[list] = [[] for _ in range(NUM_FILL_THREADS)]
    totals = [0] * NUM_FILL_THREADS
    for item in sorted(items, key=size, reverse=True):
        i = totals.index(min(totals))
        groups[i].append(item)
        totals[i] += size(item)
    return [g for g in groups if g]


def _zero_gaps(image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout) -> None:
    """Zero the alignment bytes between pieces (stale page contents otherwise)."""
    elem = layout.dtype.itemsize
    for i, p in enumerate(layout.pieces):
        spec = slot_layout.slices[p.slice]
        following = layout.pieces[i + 1].a_offset if i + 1 < len(layout.pieces) else layout.num_bytes
        for start, stop in ((p.a_offset + p.rank * spec.in_features * elem, p.b_offset),
                            (p.b_offset + p.rank * spec.max_out * elem, following)):
            for view in image.ranges(start, stop):
                view.zero_()


def _all_finite(chunks: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """No NaN or infinity in these uint8 chunks read as `dtype` (its exponent bits)."""
    if dtype not in EXPONENT_BITS:
        return all(bool(torch.isfinite(c.view(dtype)).all()) for c in chunks)
    bits, mask = EXPONENT_BITS[dtype]
    return not any(bool(((c.view(bits) & mask) == mask).any()) for c in chunks)


def _piece(image: ImageBytes, offset: int, rank: int, cols: int, dtype: torch.dtype,
           split: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """The [rank, cols] destination of a piece: in place, or a temporary written after (split)."""
    num_bytes = rank * cols * dtype.itemsize
    region = image.region(offset, num_bytes)
    if region is not None:
        return region.view(dtype).view(rank, cols)
    tmp = torch.empty(rank, cols, dtype=dtype)
    split.append((offset, tmp))
    return tmp


def _file_tensor(data: torch.Tensor, header: Header, key: str) -> torch.Tensor:
    """Tensor `key` of the file as a flat view of `data` (copied when its offset is misaligned)."""
    entry = header.tensors[key]
    dtype = FILE_DTYPES[entry.dtype]
    raw = data[entry.start : entry.stop]
    if entry.start % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)
