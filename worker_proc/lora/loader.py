"""Adapter movement, beside the steps: disk -> CPU tier on a small thread pool, CPU tier ->
GPU slot on the copy stream, completions reported as they happen.

The worker's main thread drives it: commands start loads (`assign`, `prefetch`), `poll`
moves each load on as far as it can without waiting and returns the replies that became
due, and `ensure_ready` makes a load a step needs finish its host side now (a plan that
names a slot still loading waits for it; the compute stream then waits on the copy's event).
Loader threads only read files and build images and scatter views; every other state change
happens on the main thread. Without a thread pool (`overlap` off) every job runs inline, in
command order: the same machinery, synchronous.

A load from disk reports source_tier "disk" and the bytes read (the whole files: every rank
reads and hashes them); one from the CPU tier "cpu" and the bytes copied to the device (the
rank's image: its shard of the adapter, with the table and alignment); duration_ms runs from
the command's arrival on this worker to the observed end of the load, and end_time_s is the
wall clock there. Each read from disk shows its progress and logs "loaded adapter NAME
(N MiB) in X s" when it ends (shared/progress.py).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from ledgerserve.shared.adapter_types import AdapterError
from ledgerserve.shared.events import AdapterLoadCompleted, AdapterLoadFailed
from ledgerserve.shared.progress import Progress, adapter_end_line
from ledgerserve.worker_proc.lora.cpu_tier import CpuEntry, CpuTier
from ledgerserve.worker_proc.lora.fences import SlotFences
from ledgerserve.worker_proc.lora.file_image import ImageLayout
from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool
from ledgerserve.worker_proc.lora.reader import ChangedOnDisk, FileImage, ReadSpec, read_image
from ledgerserve.worker_proc.lora.slot_copy import Event as CopyEvent
from ledgerserve.worker_proc.lora.slot_copy import Scatter, SlotCopier, launch_error

NUM_LOADER_THREADS = 2
Reply = AdapterLoadCompleted | AdapterLoadFailed
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    image: FileImage | None  # read from disk by this job
    scatter: Scatter | None  # views of the slot copy (a slot load)


@dataclass
class SlotLoad:
    slot: int
    version_id: int
    path: str
    arrival_s: float
    entry: CpuEntry
    source_tier: str
    future: Future | None = None  # the scatter views (and the read, from disk); None: waits for entry
    done: CopyEvent | None = None  # the copy's end, once queued
    num_bytes: int = 0  # to report: read from disk, or copied to the device
    error: str = ""


class AdapterLoader:
    def __init__(
        self,
        spec: ReadSpec,
        pool: PinnedPool,
        copier: SlotCopier,
        fences: SlotFences,
        rank: int,
        overlap: bool,
        on_ready: Callable[[int, int, ImageLayout, CopyEvent], None],
    ) -> None:
        """on_ready(slot, version_id, layout, event): a slot's copy is queued; steps may use it
        behind `event`. A copy into a slot waits for its last reader in `fences`."""
        self.spec, self.pool, self.copier, self.fences = spec, pool, copier, fences
        self.rank, self.on_ready = rank, on_ready
        self.executor = ThreadPoolExecutor(NUM_LOADER_THREADS, "adapter-load") if overlap else None
        self.cpu = CpuTier(pool)
        self.loads: dict[int, SlotLoad] = {}  # slot -> a load not reported yet
        self.replies: list[Reply] = []  # due, not yet returned by poll

    def assign(self, slot: int, version_id: int, path: str, content_sha256: str, arrival_s: float) -> None:
        """Start loading `version_id` into `slot` (from the CPU tier, or disk first)."""
        self.cancel(slot)
        entry = self.cpu.entries.get(version_id)
        load = SlotLoad(slot, version_id, path, arrival_s, entry, "cpu")  # type: ignore[arg-type]
        if entry is None:
            load.entry = entry = CpuEntry(version_id, None, path)
            load.source_tier = "disk"
            self.cpu.add(entry)
            entry.future = load.future = self._submit(self._read_and_scatter, slot, version_id, path, content_sha256)
        elif entry.image is not None:
            load.future = self._submit(self._scatter, slot, entry.image.layout)
        else:
            load.source_tier = "disk"  # a prefetch is reading it: wait for that
        entry.num_users += 1
        self.loads[slot] = load

    def prefetch(self, version_id: int, path: str, content_sha256: str, arrival_s: float) -> None:
        """Stage `version_id` into the CPU tier; reported (by poll) as a load into slot -1."""
        entry = self.cpu.entries.get(version_id)
        if entry is not None and entry.image is not None:
            self.replies.append(
                AdapterLoadCompleted(self.rank, -1, version_id, "cpu", _ms_since(arrival_s), 0, time.time())
            )
            return
        if entry is None:
            entry = CpuEntry(version_id, None, path)
            self.cpu.add(entry)
            entry.future = self._submit(self._read, version_id, path, content_sha256)
        if entry.report_arrival_s is None:
            entry.report_arrival_s = arrival_s

    def cancel(self, slot: int) -> CopyEvent | None:
        """Forget the slot's unreported load (evicted or replaced): it is never reported, and
        never copies if it has not yet. Returns its copy's event if the copy was queued."""
        load = self.loads.pop(slot, None)
        if load is None:
            return None
        if load.done is None and not load.error:  # else its user count already dropped
            load.entry.num_users -= 1
            self.cpu.release()
        return load.done

    def poll(self) -> list[Reply]:
        """Move every load on as far as it goes without waiting; the replies now due."""
        for entry in self.cpu.reading():
            if entry.future is not None and entry.future.done():
                self._settle(entry)
        replies, self.replies = self.replies, []
        for slot, load in list(self.loads.items()):
            if load.done is None and not load.error:
                self._advance(load, block=False)
            if load.error:
                replies.append(
                    AdapterLoadFailed(self.rank, slot, load.version_id, self._message(load.path, load.error))
                )
            elif load.done is not None and launch_error(load.done):
                replies.append(
                    AdapterLoadFailed(
                        self.rank, slot, load.version_id, self._message(load.path, launch_error(load.done))
                    )
                )
            elif load.done is not None and load.done.query():
                replies.append(
                    AdapterLoadCompleted(
                        self.rank,
                        slot,
                        load.version_id,
                        load.source_tier,
                        _ms_since(load.arrival_s),
                        load.num_bytes,
                        time.time(),
                    )
                )
            else:
                continue
            del self.loads[slot]
        self.cpu.release()
        return replies

    def ensure_ready(self, slot: int) -> None:
        """Finish the host side of the slot's pending load now, if any (its copy gets queued, or it fails)."""
        load = self.loads.get(slot)
        if load is not None and load.done is None and not load.error:
            self._advance(load, block=True)

    def failure(self, slot: int) -> str:
        """The message of the slot's failed load not reported yet, or ''."""
        load = self.loads.get(slot)
        return self._message(load.path, load.error) if load is not None and load.error else ""

    def is_busy(self) -> bool:
        return bool(self.loads) or bool(self.replies) or self.cpu.is_busy()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)

    def _advance(self, load: SlotLoad, block: bool) -> None:
        """Queue the load's copy once its image and views are there; record a failure."""
        entry = load.entry
        if entry.future is not None:
            if not (block or entry.future.done()):
                return
            self._settle(entry)
        if entry.image is None:
            load.error = entry.error
            entry.num_users -= 1
            return
        if load.future is None or (block and load.future.cancel()):  # not started: build the views here
            load.future = self._submit(self._scatter, load.slot, entry.image.layout, inline=block)
        if not (block or load.future.done()):
            return
        try:
            scatter = load.future.result().scatter
            load.done = self.copier.copy(entry.image, self.pool, scatter, self.fences.pending(load.slot))
        except Exception as e:  # a device fault while queueing fails this load only
            load.error = _reason(e)
            return
        finally:
            entry.num_users -= 1
        entry.fences.append(load.done)  # the pages stay until the copy ends, even if the tier drops them
        image = entry.image
        load.num_bytes = image.num_file_bytes if load.source_tier == "disk" else image.layout.num_bytes
        self.on_ready(load.slot, load.version_id, entry.image.layout, load.done)

    def _settle(self, entry: CpuEntry) -> None:
        """The entry's read ended: keep its image or its error; report it if it was a prefetch."""
        assert entry.future is not None
        try:
            image, error = entry.future.result().image, ""
        except Exception as e:  # any bad adapter fails only its load
            image, error = None, _reason(e)
        self.cpu.settle(entry, image, error)
        if entry.report_arrival_s is None or entry.dropped:
            return
        if image is None:
            self.replies.append(AdapterLoadFailed(self.rank, -1, entry.version_id, self._message(entry.path, error)))
        else:
            self.replies.append(
                AdapterLoadCompleted(
                    self.rank,
                    -1,
                    entry.version_id,
                    "disk",
                    _ms_since(entry.report_arrival_s),
                    image.num_file_bytes,
                    time.time(),
                )
            )

    def _read(self, version_id: int, path: str, content_sha256: str) -> LoadResult:
        return LoadResult(self._read_image(version_id, path, content_sha256), None)

    def _read_and_scatter(self, slot: int, version_id: int, path: str, content_sha256: str) -> LoadResult:
        image = self._read_image(version_id, path, content_sha256)
        return LoadResult(image, self.copier.scatter(slot, image.layout))

    def _read_image(self, version_id: int, path: str, content_sha256: str) -> FileImage:
        """read_image from disk, its progress shown and its end logged (shared/progress.py)."""
        name = _dir_name(path)
        progress = Progress(f"adapter {name}", None, self.rank, logger)
        try:
            image = read_image(self.spec, self.pool, version_id, path, content_sha256, progress)
        finally:
            elapsed_s = progress.close()
        logger.info("%s", adapter_end_line(name, image.num_file_bytes, elapsed_s))
        return image

    def _scatter(self, slot: int, layout: ImageLayout) -> LoadResult:
        return LoadResult(None, self.copier.scatter(slot, layout))

    def _submit(self, fn: Callable[..., LoadResult], *args: object, inline: bool = False) -> Future:
        """On a loader thread; inline (a future already settled) without a pool or when asked."""
        if self.executor is not None and not inline:
            return self.executor.submit(fn, *args)
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as e:
            future.set_exception(e)
        return future

    @staticmethod
    def _message(path: str, reason: str) -> str:
        name = _dir_name(path)
        return f"adapter {name} {reason}" if reason.startswith(CHANGED) else f"adapter {name}: {reason}"


CHANGED = "changed on disk"


def _reason(e: Exception) -> str:
    if isinstance(e, ChangedOnDisk):
        return e.message
    return e.message if isinstance(e, AdapterError) else str(e)


def _dir_name(path: str) -> str:
    """How the worker names an adapter: its directory's name (events carry the path, not the name)."""
    return os.path.basename(os.path.normpath(path)) or path


def _ms_since(start_s: float) -> float:
    return (time.monotonic() - start_s) * 1000.0
