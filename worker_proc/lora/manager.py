"""The worker's LoRA state: stacked buffers hung on every LoRA layer of the model, the slot
tables and the adapter movement behind them (worker_proc/lora/loader.py).

Two slot tables: `assigned` follows the commands (AdapterSlotAssigned and AdapterEvicted in
command order, with each version's content digest) and is what the rank digest covers, so
ranks agree whatever their load timing; `slots` holds the slots whose copy is queued, the
ones a step may use (behind the copy's event). Each slot's last reader is noted after each
step (worker_proc/lora/fences.py): writes into a slot wait for that step only."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ledgerserve.shared.adapter_format import BaseShapes
from ledgerserve.shared.config import EngineConfig
from ledgerserve.worker_proc.lora import layout
from ledgerserve.worker_proc.lora.fences import SlotFences
from ledgerserve.worker_proc.lora.file_image import ImageLayout, SlotLayout
from ledgerserve.worker_proc.lora.loader import AdapterLoader, Reply
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool, page_bytes_for
from ledgerserve.worker_proc.lora.reader import ReadSpec
from ledgerserve.worker_proc.lora.slot_copy import DoneEvent, Event, SlotCopier, cuda_event, flat_tables, staging_bytes
from ledgerserve.worker_proc.lora.weights import LoraWeights


@runtime_checkable
class LoraLayer(Protocol):
    """A model layer that can take per-slot LoRA buffers (worker_proc/models/layers.SlotLinear)."""

    def attach_lora(self, max_loras: int, max_rank: int, stack: bool) -> LoraWeights: ...


class LoraManager:
    def __init__(
        self,
        model: nn.Module,
        config: EngineConfig,
        base: BaseShapes,
        dtype: torch.dtype,
        device: torch.device,
        rank: int = 0,
    ) -> None:
        self.max_loras = config.max_loras
        self.device = device
        self.weights: dict[str, LoraWeights] = {}  # module path -> its slot buffers
        for name, module in model.named_modules():
            if isinstance(module, LoraLayer):
                self.weights[name] = module.attach_lora(config.max_loras, config.max_lora_rank, layout.stacks_a(name))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the unstacked weights just freed
        ranks, scalings = flat_tables(self.weights)
        self.layout = SlotLayout(self.weights)
        max_image_bytes = self.layout.max_image_bytes(config.max_lora_rank)
        self.copier = SlotCopier(
            self.weights, self.layout, ranks, scalings, staging_bytes(self.layout, config.max_lora_rank), device
        )
        page_bytes = page_bytes_for(max_image_bytes)
        max_pages = -(-max_image_bytes // page_bytes)  # one image; the tier holds max_cpu_loras, plus slack for
        num_images = config.max_cpu_loras + config.max_loras  # evicted ones whose copies are still fenced
        self.pool = PinnedPool(num_images * max_pages * page_bytes, page_bytes, pin=device.type == "cuda")
        trusted = frozenset(os.path.realpath(path) for _, path in config.lora_modules)  # as they were registered
        spec = ReadSpec(base, config.max_lora_rank, config.lora_allowed_dirs, self.layout, dtype, trusted)
        self.fences = SlotFences()
        self.loader = AdapterLoader(
            spec, self.pool, self.copier, self.fences, rank, config.lora_overlap_loading, self._on_ready
        )
        self.slots: dict[int, int] = {}  # slot -> version_id whose copy is queued: steps may use it
        self.events: dict[int, Event] = {}  # slot -> its copy's end, until seen complete
        self.assigned: dict[int, tuple[int, str]] = {}  # slot -> (version_id, content SHA-256), in command order

    def assign(self, slot: int, version_id: int, path: str, content_sha256: str, arrival_s: float) -> None:
        """Start loading `version_id` into `slot`, replacing whatever it held (ValueError: no such slot)."""
        self.check_slot(slot)
        self._vacate(slot)
        self.assigned[slot] = (version_id, content_sha256)
        self.loader.assign(slot, version_id, path, content_sha256, arrival_s)

    def load_now(self, slot: int, version_id: int, path: str, content_sha256: str, arrival_s: float) -> list[Reply]:
        """assign, then finish the load before returning: its reply is among those returned."""
        self.assign(slot, version_id, path, content_sha256, arrival_s)
        self.loader.ensure_ready(slot)
        if slot in self.events:
            self.events[slot].synchronize()
        return self.loader.poll()

    def prefetch(self, version_id: int, path: str, content_sha256: str, arrival_s: float) -> None:
        self.loader.prefetch(version_id, path, content_sha256, arrival_s)

    def evict(self, slot: int, version_id: int) -> None:
        """Free `slot` if it holds (or is loading) `version_id`; a stale evict never wipes a newer version.
        A load in flight is then never reported, and its copy, if queued, is undone behind it."""
        if self.assigned.get(slot, (None,))[0] == version_id:
            del self.assigned[slot]
        load = self.loader.loads.get(slot)
        if self.slots.get(slot) == version_id or (load is not None and load.version_id == version_id):
            self._vacate(slot)

    def drop_cpu(self, version_id: int) -> None:
        self.loader.cpu.drop(version_id)

    def poll(self) -> list[Reply]:
        return self.loader.poll()

    def prepare(self, slots: Iterable[int]) -> None:
        """Before a step that uses `slots`: finish their pending loads' host side (a plan may name a
        slot still loading) and make the current stream wait for their copies."""
        for slot in slots:
            self.loader.ensure_ready(slot)
            event = self.events.get(slot)
            if event is None:
                continue
            if event.query():
                del self.events[slot]
            else:
                torch.cuda.current_stream(self.device).wait_event(cuda_event(event))

    def note_step(self, slots: Sequence[int]) -> None:
        """A step that reads `slots` was just launched: writes into them wait for it (on the CPU
        the step is done already)."""
        if not slots:
            return
        event: Event = DoneEvent()
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.fences.read(slots, event)

    def is_busy(self) -> bool:
        return self.loader.is_busy()

    def close(self) -> None:
        self.loader.close()
        self.copier.close()

    def _on_ready(self, slot: int, version_id: int, layout: ImageLayout, event: Event) -> None:
        """The slot's copy is queued: steps may use it, and the host tables take its ranks."""
        self.slots[slot] = version_id
        self.events[slot] = event
        for spec, rank, scaling in zip(self.layout.slices, layout.ranks, layout.scalings):
            w = self.weights[spec.module]
            w.rank_table[slot][spec.index] = rank
            w.scale_table[slot][spec.index] = scaling

    def _vacate(self, slot: int) -> None:
        """Forget the slot's load or adapter; its device tables are zeroed on the copy stream, behind
        its copy and its last reader."""
        cancelled = self.loader.cancel(slot)  # the copy's event, if the load had queued it
        event = self.events.pop(slot, cancelled)
        if slot not in self.slots and event is None:
            return
        self.copier.clear(slot, self.fences.pending(slot))
        self.slots.pop(slot, None)
        for w in self.weights.values():
            w.rank_table[slot] = [0] * len(w.output_sizes)
            w.scale_table[slot] = [0.0] * len(w.output_sizes)

    @contextlib.contextmanager
    def zero_adapter(self, slot: int) -> Iterator[None]:
        """Within: `slot` (empty) holds an adapter of full rank on every slice whose weights are all
        zero, so the LoRA kernels run (an empty slot skips them) and change nothing. The start-up
        warm-up compiles them this way. Empty again after."""
        self.check_slot(slot)
        if slot in self.slots or slot in self.assigned:
            raise ValueError(f"slot {slot} holds an adapter")
        for weights in self.weights.values():
            rank, num_in = weights.max_rank, weights.a.shape[3]
            zeros = [
                (weights.a.new_zeros(rank, num_in), weights.b.new_zeros(size, rank), 0.0)
                for size in weights.output_sizes
            ]
            weights.load_slot(slot, zeros)
        try:
            yield
        finally:
            for weights in self.weights.values():
                weights.clear_slot(slot)

    def check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is outside [0, {self.max_loras})")

    def slot_table(self) -> list[list[int]]:
        """[[slot, version_id], ...] of the slots steps may use, sorted by slot."""
        return [[slot, self.slots[slot]] for slot in sorted(self.slots)]

    def digest_table(self) -> list[list[int | str]]:
        """[[slot, version_id, content SHA-256], ...] as the commands assigned them, sorted by slot."""
        return [[slot, *self.assigned[slot]] for slot in sorted(self.assigned)]
