"""An adapter version's CPU copy, its "file image": the data region of its safetensors file as
read, in file dtype and file layout (A [rank, in], B [out, rank]), after a table of every slot
slice's rank (int64) and scaling (float32).

Every (module, slice) of the slot buffers has a fixed global index (`SlotLayout`). The image
keeps the tensors the adapter uses, in runs of consecutive tensors of the data region (the
tensors it does not use, PEFT's saved copies of the embedding and lm_head, are read for the
content digest only). Each run sits at an image offset congruent to its data-region offset
modulo ALIGN_BYTES, so a tensor aligned in the file is aligned in the image. Casting to the
model dtype and transposing B into the slot buffers is the device's work
(worker_proc/lora/slot_copy.py). The image lives in pool pages (worker_proc/lora/pinned_pool.py):
a few extents, each contiguous; a tensor may straddle two of them.
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


@dataclass(frozen=True)
class SliceSpec:
    module: str
    index: int  # slice of the module
    in_features: int  # of the adapter's A [rank, in] as the file holds it
    out_features: int  # of the adapter's B [out, rank] as the file holds it
    max_out: int  # row length of B^T in the slot buffers
    rows: tuple[int, int]  # the rows [start, stop) of B this rank's slots hold (its shard of the output)
    cols: tuple[int, int]  # the columns [start, stop) of A this rank's slots hold (its shard of the input)


@dataclass(frozen=True)
class FileTensor:
    """One tensor of the image, as the file holds it."""

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
    a: FileTensor  # [rank, in]
    b: FileTensor  # [out, rank]


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
    """The global slice order of the slot buffers, and image layouts against it. An image holds the
    adapter's whole tensors; a tensor-parallel rank's slots take its shard of them (`SliceSpec.rows`,
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
        """Where the tensors of these modules go in the image; ValueError if the model lacks a module."""
        modules = list(modules)
        used = {key: header.tensors[key] for m in modules for key in (m.a_key, m.b_key)}
        runs = _runs(used.values(), _align(12 * len(self.slices)))
        pieces = []
        for m in sorted(modules, key=lambda m: self._slice_of(m.layer, m.kind)):
            spec = self.slices[self._slice_of(m.layer, m.kind)]
            a = _place(used[m.a_key], runs, (m.rank, spec.in_features))
            b = _place(used[m.b_key], runs, (spec.out_features, m.rank))
            pieces.append(Piece(self._slice_of(m.layer, m.kind), m.rank, m.scaling, a, b))
        num_bytes = runs[-1].offset + runs[-1].stop - runs[-1].start
        return ImageLayout(tuple(pieces), tuple(runs), len(self.slices), num_bytes)

    def max_image_bytes(self, max_rank: int) -> int:
        """The largest image of a file in at most F32: every slice targeted at `max_rank`, each
        tensor a run of its own (the alignment of each run)."""
        return _align(12 * len(self.slices)) + sum(
            max_rank * (s.in_features + s.out_features) * MAX_FILE_ITEMSIZE + 4 * ALIGN_BYTES for s in self.slices
        )

    def max_tensor_bytes(self, max_rank: int) -> int:
        """The largest single tensor an adapter may hold (in F64, the widest dtype a file may use)."""
        return max(max_rank * max(s.in_features, s.out_features) for s in self.slices) * 8

    def _slice_of(self, layer: int, kind: str) -> int:
        name, s = module_path(layer, kind)
        g = self.index.get((name, s))
        if g is None:
            raise ValueError(f"the model has no module {name} for this adapter")
        return g


def _runs(entries: Iterable[TensorEntry], first_offset: int) -> list[Run]:
    """Consecutive entries merged into runs, each placed after the last at the first offset
    congruent to its start modulo ALIGN_BYTES."""
    spans: list[list[int]] = []
    for entry in sorted(entries, key=lambda e: e.start):
        if spans and spans[-1][1] == entry.start:
            spans[-1][1] = entry.stop
        else:
            spans.append([entry.start, entry.stop])
    runs, offset = [], first_offset
    for start, stop in spans:
        offset = _align(offset) + start % ALIGN_BYTES
        runs.append(Run(start, stop, offset))
        offset += stop - start
    return runs


def _place(entry: TensorEntry, runs: list[Run], shape: tuple[int, int]) -> FileTensor:
    run = next(r for r in runs if r.start <= entry.start and entry.stop <= r.stop)
    return FileTensor(run.offset + entry.start - run.start, entry.dtype, shape)


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


def write_tables(image: ImageBytes, layout: ImageLayout) -> None:
    """Every slice's rank (int64) and scaling (float32) at the image's start."""
    ranks = torch.tensor(layout.ranks, dtype=torch.int64)  # [num_slices]
    scalings = torch.tensor(layout.scalings, dtype=torch.float32)  # [num_slices]
    image.write(0, torch.cat([ranks.view(torch.uint8), scalings.view(torch.uint8)]))
