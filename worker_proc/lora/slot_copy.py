"""CPU tier -> GPU slot: a file image (worker_proc/lora/file_image.py) moved on a dedicated copy
stream, the device doing the conversion.

The image's table goes to a small device buffer and its data region to a staging buffer, in a
few large host -> device copies (pinned memory on CUDA); then each tensor is copied from its
staging view (file dtype, file layout) into its slot view (model dtype; B's is the transposed
view of the B^T storage), the copy kernels casting and transposing, in `torch._foreach_copy_`
calls (one C++ loop that releases the GIL; tensors whose dtype and layout already match in
one call, which takes the fused path). A tensor-parallel rank's image holds its shard of each
tensor already (its rows of B on column-parallel layers, its columns of A on row-parallel ones),
shaped as its slot views: nothing is sliced here. Then one fused zeroing
clears every row past the adapter's rank (and every slice it does not target), and one indexed
write each sets the slot's ranks and scalings (every module's tables are views into one flat
buffer). The staging
buffer holds the largest image `max_lora_rank` allows in F32 up to MAX_STAGING_BYTES; a larger
image streams through it in chunks of whole tensors. It is allocated at start-up, before the
KV cache is sized.

The copy stream first waits for the slot's last reader (worker_proc/lora/fences.py), if that
step may still run; the copy's end is one event per load, which a step using the slot makes
the compute stream wait on. One launcher thread queues all copy-stream work, in command order:
a load queues several hundred copy kernels, milliseconds of host time that would otherwise
delay the launch of the next step (the GPU idles once that exceeds a step's length); each
kernel launch releases the GIL, so the worker's loop keeps launching steps meanwhile. On the
CPU the same copies run synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from ledgerserve.worker_proc.lora.file_image import ALIGN_BYTES, FileTensor, ImageBytes, ImageLayout, SlotLayout
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool
from ledgerserve.worker_proc.lora.reader import FileImage
from ledgerserve.worker_proc.lora.weights import LoraWeights

MAX_STAGING_BYTES = 256 << 20


class DoneEvent:
    """The CPU's stand-in for a CUDA event: work on the CPU is done when it returns."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class LaunchedEvent:
    """The end of copy-stream work the launcher thread queues: its CUDA event once launched."""

    def __init__(self, launch: Future[torch.cuda.Event]) -> None:
        self.launch = launch

    def query(self) -> bool:
        """Launched and finished on the device; or its launch failed (see `launch_error`)."""
        if not self.launch.done():
            return False
        return self.launch.exception() is not None or self.launch.result().query()

    def synchronize(self) -> None:
        self.cuda_event().synchronize()

    def cuda_event(self) -> torch.cuda.Event:
        """The CUDA event, waiting for the launch if it is still queued (it raises what the launch raised)."""
        return self.launch.result()


Event = torch.cuda.Event | DoneEvent | LaunchedEvent


def launch_error(event: Event) -> str:
    """Why the launch of `event`'s work failed, or '' (also while it is still queued)."""
    if isinstance(event, LaunchedEvent) and event.launch.done() and event.launch.exception() is not None:
        return str(event.launch.exception())
    return ""


def cuda_event(event: Event) -> torch.cuda.Event | None:
    """What a CUDA stream can wait on; None for work that is done already (the CPU's)."""
    if isinstance(event, LaunchedEvent):
        return event.cuda_event()
    return event if isinstance(event, torch.cuda.Event) else None


@dataclass
class Chunk:
    """Image bytes [start, stop) staged at once, and the copies out of them."""

    start: int
    stop: int
    same: tuple[list[torch.Tensor], list[torch.Tensor]] = field(
        default_factory=lambda: ([], [])
    )  # dtype and layout match
    cast: tuple[list[torch.Tensor], list[torch.Tensor]] = field(
        default_factory=lambda: ([], [])
    )  # cast and/or transpose
    # (dst, its bytes in staging, file dtype, shape): tensors at a file offset off their item size
    unaligned: list[tuple[torch.Tensor, torch.Tensor, torch.dtype, tuple[int, int]]] = field(default_factory=list)


@dataclass(frozen=True)
class Scatter:
    """Where one image's tensors go in one slot: the chunks' copies, and the zeroings."""

    slot: int
    chunks: list[Chunk]
    zeros: list[torch.Tensor]


def staging_bytes(layout: SlotLayout, max_rank: int) -> int:
    """The staging buffer's size: the largest F32 image, bounded, but never below one F64 tensor."""
    return max(
        min(layout.max_image_bytes(max_rank), MAX_STAGING_BYTES), layout.max_tensor_bytes(max_rank) + ALIGN_BYTES
    )


class SlotCopier:
    def __init__(
        self,
        weights: dict[str, LoraWeights],
        layout: SlotLayout,
        ranks: torch.Tensor,
        scalings: torch.Tensor,
        num_staging_bytes: int,
        device: torch.device,
    ) -> None:
        """`ranks` [n] int64 / `scalings` [n] float32: the flat tables every module's views share."""
        self.layout, self.ranks, self.scalings, self.device = layout, ranks, scalings, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.launcher = ThreadPoolExecutor(1, "adapter-copy") if self.stream is not None else None
        self.staging = torch.empty(num_staging_bytes, dtype=torch.uint8, device=device)  # [num_staging_bytes]
        self.tables = torch.empty(12 * len(layout.slices), dtype=torch.uint8, device=device)  # ranks, scalings
        max_loras = next(iter(weights.values())).a.shape[0]
        # slot -> per global slice: A [max_rank, in], and the B^T storage [max_rank, max_out] (contiguous)
        self.views: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(max_loras)]
        for spec in layout.slices:
            w = weights[spec.module]
            b_storage = w.b.transpose(2, 3)  # [max_loras, num_slices, max_rank, max_out]
            for slot in range(max_loras):
                self.views[slot].append((w.a[slot, spec.index], b_storage[slot, spec.index]))
        # [max_loras, num_slices]: where each slot's entries sit in the flat tables
        self.slot_index = _slot_index(weights, layout, max_loras).to(device)

    def scatter(self, slot: int, layout: ImageLayout) -> Scatter:
        """The views of one load (pure metadata: a loader thread builds it)."""
        targeted = {p.slice: p for p in layout.pieces}
        pairs: list[tuple[FileTensor, torch.Tensor]] = []
        zeros: list[torch.Tensor] = []
        for g, (a, b_t) in enumerate(self.views[slot]):
            p = targeted.get(g)
            if p is None:
                zeros += [a, b_t]
                continue
            out = p.b.shape[0]  # this rank's rows of B
            pairs.append((p.a, a[: p.rank]))  # [rank, in]: this rank's columns of A
            if out:
                pairs.append((p.b, b_t[: p.rank, :out].t()))  # [out, rank]: its rows of B
            if p.rank < a.shape[0]:
                zeros += [a[p.rank :], b_t[p.rank :]]
            if out < b_t.shape[1]:
                zeros.append(b_t[: p.rank, out:])
        return Scatter(slot, self._chunks(pairs), zeros)

    def copy(self, image: FileImage, pool: PinnedPool, scatter: Scatter, after: Event | None) -> Event:
        """Queue the image's move into `scatter.slot` behind `after`; the returned event marks its end."""
        return self._queue(lambda: self._copy(image, pool, scatter), after)

    def clear(self, slot: int, after: Event | None) -> Event:
        """Zero the slot's ranks and scalings (the kernels then skip it) on the copy stream, behind
        `after` and any copy queued before; the returned event marks its end."""
        return self._queue(lambda: self._clear(slot), after)

    def close(self) -> None:
        if self.launcher is not None:
            self.launcher.shutdown(wait=True)

    def _queue(self, work: Callable[[], None], after: Event | None) -> Event:
        """`work` on the copy stream behind `after`, launched by the launcher thread (run here on the CPU)."""
        if self.stream is None or self.launcher is None:
            work()
            return DoneEvent()
        return LaunchedEvent(self.launcher.submit(self._launch, work, after))

    def _launch(self, work: Callable[[], None], after: Event | None) -> torch.cuda.Event:
        assert self.stream is not None
        wait_for = cuda_event(after) if after is not None else None
        done = torch.cuda.Event()
        with torch.cuda.device(self.stream.device), torch.cuda.stream(self.stream):
            if wait_for is not None:
                self.stream.wait_event(wait_for)
            work()
            done.record(self.stream)
        return done

    def _clear(self, slot: int) -> None:
        index = self.slot_index[slot]
        self.ranks.index_fill_(0, index, 0)
        self.scalings.index_fill_(0, index, 0.0)

    def _copy(self, image: FileImage, pool: PinnedPool, scatter: Scatter) -> None:
        host = ImageBytes([pool.view(e) for e in image.extents])
        num_slices = image.layout.num_slices
        _stage(host, 0, 12 * num_slices, self.tables)
        for chunk in scatter.chunks:
            _stage(host, chunk.start, chunk.stop, self.staging)
            for dsts, srcs in (chunk.same, chunk.cast):
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
            for dst, raw, dtype, shape in chunk.unaligned:  # aligned by a device-side copy first
                dst.copy_(raw.clone().view(dtype).view(shape))
        if scatter.zeros:
            torch._foreach_zero_(scatter.zeros)
        index = self.slot_index[scatter.slot]
        self.ranks.index_put_((index,), self.tables[: 8 * num_slices].view(torch.int64))
        self.scalings.index_put_((index,), self.tables[8 * num_slices :].view(torch.float32))

    def _chunks(self, pairs: list[tuple[FileTensor, torch.Tensor]]) -> list[Chunk]:
        """The tensors in image order, in chunks of whole tensors that fit the staging buffer; each
        copies into its slot view."""
        chunks: list[Chunk] = []
        for tensor, dst in sorted(pairs, key=lambda pair: pair[0].offset):
            stop = tensor.offset + tensor.num_bytes
            if not chunks or stop - chunks[-1].start > self.staging.numel():
                start = tensor.offset - tensor.offset % ALIGN_BYTES
                if stop - start > self.staging.numel():
                    raise ValueError(f"a {tensor.num_bytes}-byte tensor does not fit the staging buffer")
                chunks.append(Chunk(start, stop))
            chunk = chunks[-1]
            chunk.stop = stop
            at = tensor.offset - chunk.start
            raw = self.staging[at : at + tensor.num_bytes]  # [num_bytes] uint8
            dtype = tensor.torch_dtype
            if at % dtype.itemsize:
                chunk.unaligned.append((dst, raw, dtype, tensor.shape))
                continue
            src = raw.view(dtype).view(tensor.shape)
            same = src.dtype == dst.dtype and dst.is_contiguous() and src.is_contiguous()
            group = chunk.same if same else chunk.cast
            group[0].append(dst)
            group[1].append(src)
        return chunks


def _stage(host: ImageBytes, start: int, stop: int, dst: torch.Tensor) -> None:
    """Image bytes [start, stop) into dst[: stop - start], one copy per extent touched."""
    at = 0
    for view in host.ranges(start, stop):
        dst[at : at + view.numel()].copy_(view, non_blocking=True)
        at += view.numel()


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
    index = [
        [offsets[s.module] + slot * len(weights[s.module].output_sizes) + s.index for s in layout.slices]
        for slot in range(max_loras)
    ]
    return torch.tensor(index, dtype=torch.int64)
