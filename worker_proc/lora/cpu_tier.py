"""The CPU tier: adapter versions held as file images in pool pages.

The scheduler owns the tier's LRU: a version enters when a load or prefetch reads it and
leaves on AdapterCpuEvicted. Leaving is deferred while the image is still being read, while
a slot load still needs it, or while a copy out of its pages may still run on the device
(each copy's event fences the pages). Main-thread only; loader threads only produce images.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field

from ledgerserve.worker_proc.lora.pinned_pool import PinnedPool
from ledgerserve.worker_proc.lora.reader import FileImage
from ledgerserve.worker_proc.lora.slot_copy import Event


@dataclass
class CpuEntry:
    version_id: int
    future: Future | None  # the read in flight (its result's `image`), None once settled
    path: str = ""
    image: FileImage | None = None
    num_users: int = 0  # slot loads that will still copy out of it
    fences: list[Event] = field(default_factory=list)  # copies out of it that may still run
    dropped: bool = False  # evicted; freed once nothing uses it
    error: str = ""  # why the read failed
    report_arrival_s: float | None = None  # a prefetch to report (slot -1): when it arrived

    @property
    def is_busy(self) -> bool:
        self.fences = [e for e in self.fences if not e.query()]
        return self.future is not None or self.num_users > 0 or bool(self.fences)


class CpuTier:
    def __init__(self, pool: PinnedPool) -> None:
        self.pool = pool
        self.entries: dict[int, CpuEntry] = {}  # version_id -> entry (reading or held)
        self.leaving: list[CpuEntry] = []  # evicted, waiting for their users and fences

    def ready(self, version_id: int) -> FileImage | None:
        entry = self.entries.get(version_id)
        return entry.image if entry is not None else None

    def add(self, entry: CpuEntry) -> None:
        if entry.version_id in self.entries:
            raise ValueError(f"version {entry.version_id} is already in the CPU tier")
        self.entries[entry.version_id] = entry

    def settle(self, entry: CpuEntry, image: FileImage | None, error: str = "") -> None:
        """The read of `entry` ended (image None: failed, saying `error`); a failed read leaves the tier."""
        entry.future, entry.image, entry.error = None, image, error
        if image is None and self.entries.get(entry.version_id) is entry:
            del self.entries[entry.version_id]
        self.release()

    def drop(self, version_id: int) -> None:
        """AdapterCpuEvicted: the version leaves now; its pages once nothing uses them."""
        entry = self.entries.pop(version_id, None)
        if entry is not None:
            entry.dropped = True
            self.leaving.append(entry)
            self.release()

    def release(self) -> None:
        """Free the pages of evicted entries nothing uses any more."""
        still = []
        for entry in self.leaving:
            if entry.is_busy:
                still.append(entry)
            elif entry.image is not None:
                self.pool.free(list(entry.image.extents))
                entry.image = None
        self.leaving = still

    def reading(self) -> list[CpuEntry]:
        """Entries whose read is in flight, held or evicted."""
        return [e for e in [*self.entries.values(), *self.leaving] if e.future is not None]

    def is_busy(self) -> bool:
        return bool(self.leaving) or bool(self.reading())
