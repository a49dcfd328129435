"""Filling a slot image from an adapter file's data section (worker_proc/lora/slot_image.py).

Every tensor is converted into its piece in the model dtype, B transposed into B^T (in
blocks of TRANSPOSE_COLS columns, which torch copies several times faster than a plain 2-D
transpose), B^T's padding columns and the alignment gaps are zeroed, then the pieces are
checked finite (exponent bits, in bounded chunks). The copies and the checks are split over a
few threads in balanced groups; torch releases the GIL in each.
"""

from __future__ import annotations

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


@dataclass
class Copies:
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    pads: list[torch.Tensor]  # B^T's columns past the slice's outputs
    split: list[tuple[int, torch.Tensor]]  # (offset, temporary) of pieces across two extents


def fill_image(image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout, header: Header,
               data: torch.Tensor) -> None:
    """Convert the adapter's tensors from `data` (the file's data section, [n] uint8) into
    the image; AdapterError if a converted value is not finite."""
    _write_tables(image, layout)
    copies = _plan(image, layout, slot_layout, header, data)
    list(_pool.map(_copy_group, _balanced(list(zip(copies.dsts, copies.srcs)), lambda c: c[0].numel())))
    if copies.pads:
        torch._foreach_zero_(copies.pads)
    for offset, tmp in copies.split:
        image.write(offset, tmp.view(-1).view(torch.uint8))
    _zero_gaps(image, layout, slot_layout)
    if not layout.pieces:
        return
    chunks = [c for v in image.ranges(layout.pieces[0].a_offset, layout.num_bytes) for c in v.split(CHECK_CHUNK_BYTES)]
    if not all(_pool.map(lambda group: _all_finite(group, layout.dtype), _balanced(chunks, torch.Tensor.numel))):
        raise AdapterError("the adapter's weights hold NaN or infinite values (in the model's dtype).")


def _write_tables(image: ImageBytes, layout: ImageLayout) -> None:
    """Every slice's rank (int64) and scaling (float32) at the image's start."""
    n = layout.num_slices
    meta = image.region(0, 12 * n)
    assert meta is not None  # the table is smaller than any page
    meta[: 8 * n].view(torch.int64).copy_(torch.tensor(layout.ranks, dtype=torch.int64))
    meta[8 * n :].view(torch.float32).copy_(torch.tensor(layout.scalings, dtype=torch.float32))


def _plan(image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout, header: Header,
          data: torch.Tensor) -> Copies:
    copies = Copies([], [], [], [])
    for p in layout.pieces:
        spec = slot_layout.slices[p.slice]
        a = _file_tensor(data, header, p.a_key).view(p.rank, spec.in_features)  # [rank, in]
        dst_a = _piece(image, p.a_offset, p.rank, spec.in_features, layout.dtype, copies.split)
        copies.dsts.append(dst_a)
        copies.srcs.append(a)
        b = _file_tensor(data, header, p.b_key).view(spec.out_features, p.rank)  # [out, rank]
        dst_b = _piece(image, p.b_offset, p.rank, spec.max_out, layout.dtype, copies.split)  # [rank, max_out]
        dst, src = _transposing(dst_b[:, : spec.out_features], b)
        copies.dsts.append(dst)
        copies.srcs.append(src)
        if spec.max_out > spec.out_features:
            copies.pads.append(dst_b[:, spec.out_features :])
    return copies


def _transposing(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views copying src [out, rank] into dst [rank, out] as its transpose, in column blocks."""
    out, rank = src.shape
    if out % TRANSPOSE_COLS:
        return dst, src.t()
    blocks = out // TRANSPOSE_COLS
    # dst [rank, blocks, cols] <- src [blocks, cols, rank] permuted
    return dst.view(rank, blocks, TRANSPOSE_COLS), src.view(blocks, TRANSPOSE_COLS, rank).permute(2, 0, 1)


def _balanced(items: list, size) -> list[list]:
    """`items` in NUM_FILL_THREADS groups of about equal total size (largest first, to the lightest)."""
    groups: list[list] = [[] for _ in range(NUM_FILL_THREADS)]
    totals = [0] * NUM_FILL_THREADS
    for item in sorted(items, key=size, reverse=True):
        i = totals.index(min(totals))
        groups[i].append(item)
        totals[i] += size(item)
    return [g for g in groups if g]


def _copy_group(group: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    torch._foreach_copy_([d for d, _ in group], [s for _, s in group])


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
