"""An adapter's CPU copy laid out as its GPU slot: the "slot image".

Every (module, slice) of the slot buffers has a fixed global index (`SlotLayout`). An image
holds, in the model dtype: a table of every slice's rank (int64) and scaling (float32), then
for each slice the adapter targets A [rank, in] and B^T [rank, max_out] (B transposed,
zero-padded to the buffer's row length). Each piece then has one contiguous destination in
the slot buffers: `a[slot, s, :rank]` and the B storage's `[slot, s, :rank, :]`, so moving an
image into a slot is a few large copies and one fused scatter (worker_proc/lora/slot_copy.py).
The image lives in pool pages (worker_proc/lora/pinned_pool.py): a few extents, each
contiguous; a piece that straddles two extents is converted apart and split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.adapter_types import AdapterError, AdapterManifest
from shared.safetensors_header import Header
from worker_proc.lora.weights import LoraWeights

ALIGN_BYTES = 64
CHECK_CHUNK_BYTES = 4 << 20  # the finiteness check's temporaries stay this small
# model dtype -> (its bits as an int, the exponent mask): all exponent bits set is inf or NaN
EXPONENT_BITS = {torch.float32: (torch.int32, 0x7F800000), torch.bfloat16: (torch.int16, 0x7F80),
                 torch.float16: (torch.int16, 0x7C00)}
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# PEFT module kind -> (our module path under a decoder layer, slice of that fused module)
SLICES = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
    "lm_head": ("lm_head", 0),
}


def module_path(layer: int, kind: str) -> tuple[str, int]:
    """(our module path, slice) of a PEFT module."""
    suffix, s = SLICES[kind]
    return (suffix if kind == "lm_head" else f"model.layers.{layer}.{suffix}"), s


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class SliceSpec:
    module: str
    index: int  # slice of the module
    in_features: int
    out_features: int
    max_out: int  # row length of B^T in the slot buffers


@dataclass(frozen=True)
class Piece:
    slice: int  # global slice index
    rank: int
    scaling: float
    a_key: str
    b_key: str
    a_offset: int  # bytes into the image
    b_offset: int


@dataclass(frozen=True)
class ImageLayout:
    pieces: tuple[Piece, ...]
    num_slices: int
    num_bytes: int
    dtype: torch.dtype

    @property
    def ranks(self) -> list[int]:
        """Every global slice's rank (0: not targeted)."""
        out = [0] * self.num_slices
        for p in self.pieces:
            out[p.slice] = p.rank
        return out

    @property
    def scalings(self) -> list[float]:
        """Every global slice's scaling, rounded to float32 as the buffers store it."""
        out = [0.0] * self.num_slices
        for p in self.pieces:
            out[p.slice] = float(torch.tensor(p.scaling, dtype=torch.float32))
        return out


class SlotLayout:
    """The global slice order of the slot buffers, and image layouts against it."""

    def __init__(self, weights: dict[str, LoraWeights]) -> None:
        self.slices: list[SliceSpec] = []
        self.index: dict[tuple[str, int], int] = {}
        for name, w in weights.items():
            for s, out in enumerate(w.output_sizes):
                self.index[(name, s)] = len(self.slices)
                self.slices.append(SliceSpec(name, s, w.a.shape[3], out, w.b.shape[2]))

    def plan(self, manifest: AdapterManifest, dtype: torch.dtype) -> ImageLayout:
        """Where each piece of this adapter goes; ValueError if the model lacks a module."""
        elem = dtype.itemsize
        offset = _align(12 * len(self.slices))  # ranks int64, scalings float32
        pieces = []
        for m in sorted(manifest.modules, key=lambda m: self._slice_of(m.layer, m.kind)):
            g = self._slice_of(m.layer, m.kind)
            spec = self.slices[g]
            a_offset, b_offset = offset, offset + _align(m.rank * spec.in_features * elem)
            offset = b_offset + _align(m.rank * spec.max_out * elem)
            pieces.append(Piece(g, m.rank, m.scaling, m.a_key, m.b_key, a_offset, b_offset))
        return ImageLayout(tuple(pieces), len(self.slices), offset, dtype)

    def max_image_bytes(self, max_rank: int, dtype: torch.dtype) -> int:
        """The largest image: every slice targeted at `max_rank`."""
        elem = dtype.itemsize
        return _align(12 * len(self.slices)) + sum(
            _align(max_rank * s.in_features * elem) + _align(max_rank * s.max_out * elem) for s in self.slices)

    def _slice_of(self, layer: int, kind: str) -> int:
        name, s = module_path(layer, kind)
        g = self.index.get((name, s))
        if g is None:
            raise ValueError(f"the model has no module {name} for this adapter")
        return g


class ImageBytes:
    """An image's bytes over its extents (uint8 views, in image order)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views
        self.starts = [0]
        for v in views:
            self.starts.append(self.starts[-1] + v.numel())

    def region(self, offset: int, num_bytes: int) -> torch.Tensor | None:
        """[num_bytes] uint8 at `offset` if it lies inside one extent, else None."""
        for i, view in enumerate(self.views):
            start = offset - self.starts[i]
            if 0 <= start < view.numel():
                return view[start : start + num_bytes] if start + num_bytes <= view.numel() else None
        raise ValueError(f"offset {offset} is outside the image")

    def ranges(self, start: int, stop: int) -> list[torch.Tensor]:
        """uint8 views covering bytes [start, stop) of the image, one per extent touched."""
        out = []
        for i, view in enumerate(self.views):
            lo, hi = max(start, self.starts[i]), min(stop, self.starts[i + 1])
            if lo < hi:
                out.append(view[lo - self.starts[i] : hi - self.starts[i]])
        return out

    def write(self, offset: int, data: torch.Tensor) -> None:
        """Copy `data` [n] uint8 into the image at `offset`, across extents."""
        done = 0
        for i, view in enumerate(self.views):
            lo, hi = max(offset + done, self.starts[i]), min(offset + data.numel(), self.starts[i + 1])
            if lo < hi:
                view[lo - self.starts[i] : hi - self.starts[i]].copy_(data[lo - offset : hi - offset])
                done = hi - offset


def fill_image(image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout, header: Header,
               data: torch.Tensor) -> None:
    """Convert the adapter's tensors from `data` (the file's data section, [n] uint8) into the
    image: one fused copy (dtype conversion and B's transpose included), one fused zeroing of
    B^T's padding columns and of the alignment gaps; AdapterError if a converted value is not
    finite (checked over the image's pieces, contiguous, in bounded chunks)."""
    meta = image.region(0, 12 * layout.num_slices)
    assert meta is not None  # the table is smaller than any page
    meta[: 8 * layout.num_slices].view(torch.int64).copy_(torch.tensor(layout.ranks, dtype=torch.int64))
    meta[8 * layout.num_slices :].view(torch.float32).copy_(torch.tensor(layout.scalings, dtype=torch.float32))
    dsts, srcs, pads, split = [], [], [], []
    for p in layout.pieces:
        spec = slot_layout.slices[p.slice]
        a = _file_tensor(data, header, p.a_key).view(p.rank, spec.in_features)  # [rank, in]
        b = _file_tensor(data, header, p.b_key).view(spec.out_features, p.rank).t()  # [rank, out]
        for offset, src, cols in ((p.a_offset, a, spec.in_features), (p.b_offset, b, spec.max_out)):
            dst = _piece(image, offset, p.rank, cols, layout.dtype, split)  # [rank, cols]
            dsts.append(dst[:, : src.shape[1]])
            srcs.append(src)
            if cols > src.shape[1]:
                pads.append(dst[:, src.shape[1] :])
    torch._foreach_copy_(dsts, srcs)
    if pads:
        torch._foreach_zero_(pads)
    for offset, tmp in split:
        image.write(offset, tmp.view(-1).view(torch.uint8))
    _zero_gaps(image, layout, slot_layout)
    if layout.pieces and not _all_finite(image, layout.pieces[0].a_offset, layout.num_bytes, layout.dtype):
        raise AdapterError("the adapter's weights hold NaN or infinite values (in the model's dtype).")


def _zero_gaps(image: ImageBytes, layout: ImageLayout, slot_layout: SlotLayout) -> None:
    """Zero the alignment bytes between pieces (stale page contents otherwise)."""
    elem = layout.dtype.itemsize
    ends = []  # (end of a piece's data, start of the next thing)
    for i, p in enumerate(layout.pieces):
        spec = slot_layout.slices[p.slice]
        following = layout.pieces[i + 1].a_offset if i + 1 < len(layout.pieces) else layout.num_bytes
        ends += [(p.a_offset + p.rank * spec.in_features * elem, p.b_offset),
                 (p.b_offset + p.rank * spec.max_out * elem, following)]
    for start, stop in ends:
        for view in image.ranges(start, stop):
            view.zero_()


def _all_finite(image: ImageBytes, start: int, stop: int, dtype: torch.dtype) -> bool:
    """No NaN or infinity in bytes [start, stop) of the image, read as `dtype` (its exponent bits)."""
    if dtype not in EXPONENT_BITS:
        return all(bool(torch.isfinite(v.view(dtype)).all()) for v in image.ranges(start, stop))
    bits, mask = EXPONENT_BITS[dtype]
    for view in image.ranges(start, stop):
        for chunk in view.split(CHECK_CHUNK_BYTES):
            if bool(((chunk.view(bits) & mask) == mask).any()):
                return False
    return True


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
