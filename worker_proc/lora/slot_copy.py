"""CPU tier -> GPU slot: a slot image moved on a dedicated copy stream.

An image's extents go to a device staging buffer in a few large copies (pinned memory on
CUDA), then one fused copy scatters its pieces to their contiguous destinations in the slot
buffers, one fused zeroing clears every row past the adapter's rank, and one indexed write
each sets the slot's ranks and scalings (every module's tables are views into one flat
buffer). The copy stream first waits for an event the caller recorded on the compute stream
(a step launched earlier may still read the slot); the copy's end is one event per load,
which a step using the slot makes the compute stream wait on. The staging buffer is sized
for the largest image `max_lora_rank` allows and allocated at start-up, before the KV cache
is sized. On the CPU the same code runs synchronously.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_proc.lora.pinned_pool import PinnedPool
from worker_proc.lora.reader import SlotImage
from worker_proc.lora.slot_image import ImageLayout, SlotLayout
from worker_proc.lora.weights import LoraWeights


class DoneEvent:
    """The CPU's stand-in for a CUDA event: work on the CPU is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


Event = torch.cuda.Event | DoneEvent


@dataclass(frozen=True)
class Scatter:
    """Where one image's pieces go in one slot: copies (dst, src in staging) and zeroings."""

    slot: int
    dsts: list[torch.Tensor]
    srcs: list[torch.Tensor]
    zeros: list[torch.Tensor]


class SlotCopier:
    def __init__(self, weights: dict[str, LoraWeights], layout: SlotLayout, ranks: torch.Tensor,
                 scalings: torch.Tensor, max_image_bytes: int, device: torch.device) -> None:
        """`ranks` [n] int64 / `scalings` [n] float32: the flat tables every module's views share."""
        self.layout, self.ranks, self.scalings, self.device = layout, ranks, scalings, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staging = torch.empty(max_image_bytes, dtype=torch.uint8, device=device)  # [max_image_bytes]
        max_loras = next(iter(weights.values())).a.shape[0]
        # slot -> per global slice: flat A storage [max_rank * in], flat B^T storage [max_rank * max_out]
        self.flats: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max_loras)]
        for spec in layout.slices:
            w = weights[spec.module]
            b_storage = w.b.transpose(2, 3)  # [max_loras, num_slices, max_rank, max_out], contiguous
            for slot in range(max_loras):
                self.flats[slot].append((w.a[slot, spec.index].view(-1), b_storage[slot, spec.index].view(-1)))
        # [max_loras, num_slices]: where each slot's entries sit in the flat tables
        self.slot_index = _slot_index(weights, layout, max_loras).to(device)

    def scatter(self, slot: int, layout: ImageLayout) -> Scatter:
        """The views of one load (pure metadata: a loader thread builds it)."""
        staging = self.staging
        dsts, srcs, zeros = [], [], []
        targeted = {p.slice: p for p in layout.pieces}
        for g, (a_flat, b_flat) in enumerate(self.flats[slot]):
            p = targeted.get(g)
            if p is None:
                zeros += [a_flat, b_flat]
                continue
            spec = self.layout.slices[g]
            for flat, offset, cols in ((a_flat, p.a_offset, spec.in_features), (b_flat, p.b_offset, spec.max_out)):
                n = p.rank * cols
                dsts.append(flat[:n])
                srcs.append(staging[offset : offset + n * layout.dtype.itemsize].view(layout.dtype))
                if n < flat.numel():
                    zeros.append(flat[n:])
        return Scatter(slot, dsts, srcs, zeros)

    def copy(self, image: SlotImage, pool: PinnedPool, scatter: Scatter, after: Event | None) -> Event:
        """Queue the image's move into `scatter.slot` behind `after`; the returned event marks its end."""
        if self.stream is None:
            self._copy(image, pool, scatter)
            return DoneEvent()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.stream):
            if isinstance(after, torch.cuda.Event):
                self.stream.wait_event(after)
            self._copy(image, pool, scatter)
            done.record(self.stream)
        return done

    def clear_tables(self, slot: int) -> None:
        """Zero the slot's ranks and scalings on the current stream (the kernels then skip it)."""
        index = self.slot_index[slot]
        self.ranks.index_fill_(0, index, 0)
        self.scalings.index_fill_(0, index, 0.0)

    def _copy(self, image: SlotImage, pool: PinnedPool, scatter: Scatter) -> None:
        num_bytes = image.layout.num_bytes
        start = 0
        for extent in image.extents:  # a few large host -> device copies
            view = pool.view(extent)
            n = min(view.numel(), num_bytes - start)
            self.staging[start : start + n].copy_(view[:n], non_blocking=True)
            start += n
        torch._foreach_copy_(scatter.dsts, scatter.srcs)
        if scatter.zeros:
            torch._foreach_zero_(scatter.zeros)
        num_slices = image.layout.num_slices
        index = self.slot_index[scatter.slot]
        self.ranks.index_put_((index,), self.staging[: 8 * num_slices].view(torch.int64))
        self.scalings.index_put_((index,), self.staging[8 * num_slices : 12 * num_slices].view(torch.float32))


def flat_tables(weights: dict[str, LoraWeights]) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every module's ranks / scalings into one flat buffer each; each module keeps a
    [max_loras, num_slices] view. Call before anything captures the tables (CUDA graphs)."""
    ws = list(weights.values())
    num = sum(w.ranks.numel() for w in ws)
    ranks = torch.zeros(num, dtype=torch.int64, device=ws[0].ranks.device)
    scalings = torch.zeros(num, dtype=torch.float32, device=ws[0].ranks.device)
    offset = 0
    for w in ws:
        n = w.ranks.numel()
        ranks[offset : offset + n].copy_(w.ranks.view(-1))
        scalings[offset : offset + n].copy_(w.scalings.view(-1))
        w.ranks = ranks[offset : offset + n].view(w.ranks.shape)
        w.scalings = scalings[offset : offset + n].view(w.scalings.shape)
        offset += n
    return ranks, scalings


def _slot_index(weights: dict[str, LoraWeights], layout: SlotLayout, max_loras: int) -> torch.Tensor:
    """[max_loras, num_slices] int64: flat-table position of (slot, global slice)."""
    offsets, offset = {}, 0
    for name, w in weights.items():
        offsets[name] = offset
        offset += w.ranks.numel()
    index = [[offsets[s.module] + slot * len(weights[s.module].output_sizes) + s.index for s in layout.slices]
             for slot in range(max_loras)]
    return torch.tensor(index, dtype=torch.int64)
