"""Filling a slot image from an adapter file's data section (worker_proc/lora/slot_image.py),
while that section is being read.

Every tensor is converted into its piece in the model dtype, B transposed into B^T (in
blocks of TRANSPOSE_COLS columns, which torch copies several times faster than a plain 2-D
transpose), as soon as its bytes have arrived; B^T's padding columns are zeroed and the piece
checked finite (its exponent bits) right after. This runs on a few threads, in balanced
groups; torch releases the GIL in each. The alignment bytes between pieces are never read.
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
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# model dtype -> (its bits as an int, the exponent mask): all exponent bits set is inf or NaN
EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                 torch.float16: (torch.int16, 0x7C00)}
_pool = ThreadPoolExecutor(NUM_FILL_THREADS, "adapter-fill")


@dataclass(frozen=True)
class Copy:
    end: int  # the source tensor's last byte + 1 in the data section
    piece: torch.Tensor  # [rank, cols]: the whole piece, padding included
    key: str  # the source tensor
    shape: tuple[int, int]  # its [rows, cols] in the file
    transpose: bool  # B: the source's transpose goes to the piece's first `rows` columns


class ImageFiller:
    """Fills an image while the file's data section (`data`, [n] uint8) is being read: the
    copies whose source bytes have arrived run on the fill threads meanwhile. `finish` waits
    for them (AdapterError if a piece is not finite); after a failure elsewhere, `abandon`
    does: either before the data buffer or the image is reused."""

    def __init__(self, image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout, header: Header,
                 data: torch.Tensor) -> None:
        self.image, self.layout, self.slot_layout, self.header, self.data = image, layout, slot_layout, header, data
        _write_tables(image, layout)
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
        for group in _balanced(ready, lambda c: c.piece.numel()):
            self.futures.append(_pool.submit(self._copy_group, group))

    def finish(self) -> None:
        self.arrived(self.data.numel())
        self.wait()
        for offset, tmp in self.split:
            self.image.write(offset, tmp.view(-1).view(torch.uint8))

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
            a = _piece(self.image, p.a_offset, p.rank, spec.in_features, dtype, self.split)  # [rank, in]
            copies.append(Copy(self.header.tensors[p.a_key].stop, a, p.a_key, (p.rank, spec.in_features), False))
            b = _piece(self.image, p.b_offset, p.rank, spec.max_out, dtype, self.split)  # [rank, max_out]
            copies.append(Copy(self.header.tensors[p.b_key].stop, b, p.b_key, (spec.out_features, p.rank), True))
        return copies

    def _copy_group(self, group: list[Copy]) -> None:
        """Convert a group of pieces, zero their padding, check them finite."""
        dsts, srcs, pads = [], [], []
        for c in group:
            src = _file_tensor(self.data, self.header, c.key).view(c.shape)
            if not c.transpose:
                dsts.append(c.piece)
                srcs.append(src)
                continue
            out = c.shape[0]
            dst, src = _transposing(c.piece[:, :out], src)
            dsts.append(dst)
            srcs.append(src)
            if c.piece.shape[1] > out:
                pads.append(c.piece[:, out:])
        torch._foreach_copy_(dsts, srcs)
        if pads:
            torch._foreach_zero_(pads)
        if not _all_finite([c.piece for c in group], self.layout.dtype):
            raise AdapterError("the adapter's weights hold NaN or infinite values (in the model's dtype).")


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


def _all_finite(pieces: list[torch.Tensor], dtype: torch.dtype) -> bool:
    """No NaN or infinity in these contiguous pieces of `dtype` (their exponent bits)."""
    if dtype not in EXPONENT_BITS:
        return all(bool(torch.isfinite(p).all()) for p in pieces)
    bits, mask = EXPONENT_BITS[dtype]
    return not any(bool(((p.view(bits) & mask) == mask).any()) for p in pieces)


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
