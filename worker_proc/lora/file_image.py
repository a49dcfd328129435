"""An adapter version's CPU copy, its "file image": this rank's shard of each tensor the adapter
uses, in file dtype and file layout (A [rank, cols], B [rows, rank]), after a table of every slot
slice's rank (int64) and scaling (float32).

Every (module, slice) of the slot buffers has a fixed global index (`SlotLayout`), and holds a
part of each adapter tensor fixed by the base layer's shard (worker_proc/models/shard.py): all of
A and its rows of B on column-parallel layers, its columns of A and all of B on row-parallel ones
(the whole tensors with one rank). That part is a set of byte ranges of the data region: one for
B (whole rows), one per row of A (one when it holds all the columns). The image keeps those
ranges, in runs: ranges that follow each other in the file merge; a tensor's ranges sit back to
back, so each kept tensor is contiguous in the image; a tensor's first run sits at an image offset
congruent to its data-region offset modulo ALIGN_BYTES, so a tensor aligned in the file is aligned
in the image. The bytes the image leaves out (the other ranks' parts, and PEFT's saved copies of
the embedding and lm_head) are read for the content digest only. Casting to the model dtype and
transposing B into the slot buffers is the device's work (worker_proc/lora/slot_copy.py). The
image lives in pool pages (worker_proc/lora/pinned_pool.py): a few extents, each contiguous; a
tensor may straddle two of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

import torch

from ledgerserve.shared.adapter_types import LoraModule
from ledgerserve.shared.safetensors_header import Header, TensorEntry
from ledgerserve.worker_proc.lora.weights import LoraWeights

ALIGN_BYTES = 64
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_FILE_ITEMSIZE = 4  # F32: the largest file dtype the pool and the staging buffer are sized for
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


Span = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class SliceSpec:
    module: str
    index: int  # slice of the module
    in_features: int  # of the adapter's A [rank, in] as the file holds it
    out_features: int  # of the adapter's B [out, rank] as the file holds it
    max_out: int  # row length of B^T in the slot buffers
    rows: Span  # the rows [start, stop) of B this rank's slots hold (its shard of the output)
    cols: Span  # the columns [start, stop) of A this rank's slots hold (its shard of the input)

    def a_ranges(self, entry: TensorEntry, rank: int) -> list[Span]:
        """This rank's columns of A [rank, in]: one data-region byte range per row."""
        size, (lo, hi), row = FILE_DTYPES[entry.dtype].itemsize, self.cols, entry.shape[1]
        return [(entry.start + (r * row + lo) * size, entry.start + (r * row + hi) * size) for r in range(rank)]

    def b_ranges(self, entry: TensorEntry, rank: int) -> list[Span]:
        """This rank's rows of B [out, rank]: one data-region byte range."""
        size, (lo, hi) = FILE_DTYPES[entry.dtype].itemsize, self.rows
        return [(entry.start + lo * rank * size, entry.start + hi * rank * size)]


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the image: this rank's part of a file tensor, in file dtype, contiguous."""

    offset: int  # bytes into the image
    dtype: str  # safetensors dtype name
    shape: tuple[int, int]

    @property
    def torch_dtype(self) -> torch.dtype:
        return FILE_DTYPES[self.dtype]

    @property
    def num_bytes(self) -> int:
        return self.shape[0] * self.shape[1] * self.torch_dtype.itemsize


@dataclass(frozen=True)
class Piece:
    slice: int  # global slice index
    rank: int
    scaling: float
    a: FileTensor  # [rank, cols]
    b: FileTensor  # [rows, rank]


@dataclass(frozen=True)
class Run:
    """Bytes [start, stop) of the data region, kept at `offset` in the image."""

    start: int
    stop: int
    offset: int


@dataclass(frozen=True)
class ImageLayout:
    pieces: tuple[Piece, ...]
    runs: tuple[Run, ...]  # in file order
    num_slices: int
    num_bytes: int

    @property
    def table_bytes(self) -> int:
        """The ranks (int64) and scalings (float32) of every global slice, at the image's start."""
        return 12 * self.num_slices

    @cached_property
    def ranks(self) -> list[int]:
        """Every global slice's rank (0: not targeted)."""
        out = [0] * self.num_slices
        for p in self.pieces:
            out[p.slice] = p.rank
        return out

    @cached_property
    def scalings(self) -> list[float]:
        """Every global slice's scaling, rounded to float32 as the buffers store it."""
        out = [0.0] * self.num_slices
        for p in self.pieces:
            out[p.slice] = p.scaling
        return torch.tensor(out, dtype=torch.float32).tolist()


class SlotLayout:
    """The global slice order of the slot buffers, and image layouts against it. A tensor-parallel
    rank's slots, and so its images, hold its shard of each adapter tensor (`SliceSpec.rows`,
    `.cols`: sharded B rows on column-parallel layers, sharded A columns on row-parallel ones)."""

    def __init__(self, weights: dict[str, LoraWeights]) -> None:
        self.slices: list[SliceSpec] = []
        self.index: dict[tuple[str, int], int] = {}
        for name, w in weights.items():
            num_in = w.a.shape[3]
            for s, out in enumerate(w.output_sizes):
                self.index[(name, s)] = len(self.slices)
                if w.shard is None:
                    spec = SliceSpec(name, s, num_in, out, w.b.shape[2], (0, out), (0, num_in))
                else:
                    shard = w.shard
                    spec = SliceSpec(name, s, shard.in_full, shard.out_full[s], w.b.shape[2], shard.rows[s], shard.cols)
                self.slices.append(spec)

    def plan(self, modules: Iterable[LoraModule], header: Header) -> ImageLayout:
        """Where this rank's part of the tensors of these modules goes in the image; ValueError if
        the model lacks a module."""
        parts: list[tuple[int, LoraModule, list[Span], list[Span]]] = []
        for m in modules:
            g = self._slice_of(m.layer, m.kind)
            spec = self.slices[g]
            a, b = header.tensors[m.a_key], header.tensors[m.b_key]
            parts.append((g, m, spec.a_ranges(a, m.rank), spec.b_ranges(b, m.rank)))
        runs, offsets, num_bytes = _runs([ranges for *_, a, b in parts for ranges in (a, b)], self._table_end)
        pieces = []
        for t, (g, m, _, _) in sorted(enumerate(parts), key=lambda part: part[1][0]):
            spec = self.slices[g]
            a = FileTensor(offsets[2 * t], header.tensors[m.a_key].dtype, (m.rank, _length(spec.cols)))
            b = FileTensor(offsets[2 * t + 1], header.tensors[m.b_key].dtype, (_length(spec.rows), m.rank))
            pieces.append(Piece(g, m.rank, m.scaling, a, b))
        return ImageLayout(tuple(pieces), tuple(runs), len(self.slices), num_bytes)

    def max_image_bytes(self, max_rank: int) -> int:
        """The largest image of a file in at most F32: every slice targeted at `max_rank`, each
        tensor a run of its own (the alignment of each run)."""
        return self._table_end + sum(
            max_rank * (_length(s.cols) + _length(s.rows)) * MAX_FILE_ITEMSIZE + 4 * ALIGN_BYTES for s in self.slices
        )

    def max_tensor_bytes(self, max_rank: int) -> int:
        """The largest single tensor an image may hold (in F64, the widest dtype a file may use)."""
        return max(max_rank * max(_length(s.cols), _length(s.rows)) for s in self.slices) * 8

    @property
    def _table_end(self) -> int:
        return _align(12 * len(self.slices))

    def _slice_of(self, layer: int, kind: str) -> int:
        name, s = module_path(layer, kind)
        g = self.index.get((name, s))
        if g is None:
            raise ValueError(f"the model has no module {name} for this adapter")
        return g


def _length(span: Span) -> int:
    return span[1] - span[0]


def _runs(tensors: list[list[Span]], first_offset: int) -> tuple[list[Run], list[int], int]:
    """Each tensor's kept ranges (in file order within it) placed in the image: the runs in file
    order, each tensor's image offset and the image's end. Ranges that follow each other in the
    file merge into one run; a tensor's first range starts at the first offset past the last
    congruent to its start modulo ALIGN_BYTES, its other ranges follow it back to back."""
    runs: list[Run] = []
    offsets = [first_offset] * len(tensors)
    offset = first_offset  # the image's end so far
    for t in sorted(range(len(tensors)), key=lambda t: tensors[t][0][0]):
        first = True
        for start, stop in tensors[t]:
            if start == stop:
                continue
            if runs and runs[-1].stop == start:
                runs[-1] = Run(runs[-1].start, stop, runs[-1].offset)
            else:
                if first:
                    offset = _align(offset) + start % ALIGN_BYTES
                runs.append(Run(start, stop, offset))
            if first:
                offsets[t], first = offset, False
            offset += stop - start
    return runs, offsets, offset


class ImageBytes:
    """An image's bytes over its extents (uint8 views, in image order)."""

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views
        self.starts = [0]
        for v in views:
            self.starts.append(self.starts[-1] + v.numel())

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
        for view in self.ranges(offset, offset + data.numel()):
            view.copy_(data[done : done + view.numel()])
            done += view.numel()

    def put(self, offset: int, data: memoryview) -> None:
        """Copy host bytes `data` into the image at `offset`, across extents (a plain memory copy)."""
        stop, done = offset + len(data), 0
        for i, memory in enumerate(self.memory):
            lo, hi = max(offset, self.starts[i]), min(stop, self.starts[i + 1])
            if lo < hi:
                memory[lo - self.starts[i] : hi - self.starts[i]] = data[done : done + hi - lo]
                done += hi - lo

    @cached_property
    def memory(self) -> list[memoryview]:
        """The extents' bytes as host memory."""
        return [memoryview(view.numpy()) for view in self.views]


def write_tables(image: ImageBytes, layout: ImageLayout) -> None:
    """Every slice's rank (int64) and scaling (float32) at the image's start."""
    ranks = torch.tensor(layout.ranks, dtype=torch.int64)  # [num_slices]
    scalings = torch.tensor(layout.scalings, dtype=torch.float32)  # [num_slices]
    image.write(0, torch.cat([ranks.view(torch.uint8), scalings.view(torch.uint8)]))
