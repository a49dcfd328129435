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

from shared.adapter_types import AdapterManifest
from worker_proc.lora.weights import LoraWeights

ALIGN_BYTES = 64
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
