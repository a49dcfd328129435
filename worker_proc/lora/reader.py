"""Disk -> CPU tier: one adapter version read, checked and kept as its file image
(worker_proc/lora/file_image.py): this rank's shard of each tensor the adapter uses.

The bounded reader (`read_manifest`: containment, config, header, shapes) opens and checks the
files, and hands the open weights file to `_ImageRead`, which reads it front to back with
positional reads (nothing converted on the host, nothing unpickled) while a helper thread hashes
every byte of it after the config's: each rank reads and hashes the whole file, so each checks
the version's content digest (SHA-256, shared/adapter_digest.py), but keeps only its shard. A long
run of kept bytes (a whole tensor or more, with one rank) is read straight into the image's pool
pages; everything else is read through a small scratch buffer, and the kept ranges in it (a
shard's rows of B, the rows of its columns of A) are copied into the pages. What is hashed is
exactly what is used: the config's and the header's bytes as they were parsed, each data byte as
it was read into the pages or the scratch it is copied from; nothing is read twice. A version
registered with a content digest must hash the same, all 256 bits, or the load fails. Then,
whatever the digest, the values kept are checked as the slots will hold them
(worker_proc/lora/image_check.py): NaN or infinite once cast to the model's dtype fails the load.

A run-time adapter (anything but the trusted start-up `--lora-modules`) must still resolve inside
a `--lora-allowed-dir` root when the worker reads it, its files too: a directory swapped for a link
out of the roots since its registration is refused. Runs on a loader thread: the reads, the hash
and the check release the GIL, and a load takes it a few times per chunk read.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ledgerserve.shared.adapter_digest import ContentDigest, same_content, short
from ledgerserve.shared.adapter_format import WEIGHTS_FILE, AdapterError, BaseShapes, LoraModule, read_manifest
from ledgerserve.shared.progress import Progress
from ledgerserve.shared.safetensors_header import Header
from ledgerserve.worker_proc.lora.file_image import ImageBytes, ImageLayout, Run, SlotLayout, write_tables
from ledgerserve.worker_proc.lora.image_check import check_image
from ledgerserve.worker_proc.lora.pinned_pool import Extent, PinnedPool, PoolFull

READ_CHUNK_BYTES = 16 << 20  # one positional read; the hash of a chunk runs beside the next read
DIRECT_READ_BYTES = 1 << 20  # a run this long is read straight into its pages, a shorter one through scratch
_local = threading.local()  # each loader thread's scratch buffers


class ChangedOnDisk(AdapterError):
    """The files no longer hash to the version's registered content digest."""


@dataclass(frozen=True)
class ReadSpec:
    """What every read of this worker checks against."""

    base: BaseShapes
    max_lora_rank: int
    allowed_dirs: tuple[str, ...]
    slot_layout: SlotLayout
    dtype: torch.dtype  # the model's: every read's values must be finite in it
    trusted_paths: frozenset[str] = frozenset()  # real paths of the start-up adapters: not confined to allowed_dirs

    def confines(self, path: str) -> bool:
        """Whether the adapter registered at real path `path` must lie inside allowed_dirs (every
        one but a start-up adapter, where run-time loads are allowed at all)."""
        return bool(self.allowed_dirs) and path not in self.trusted_paths


@dataclass(frozen=True)
class FileImage:
    version_id: int
    content_sha256: str  # as read (the registered one when it was given)
    layout: ImageLayout
    extents: tuple[Extent, ...]
    num_file_bytes: int  # bytes read from disk


def read_image(
    spec: ReadSpec, pool: PinnedPool, version_id: int, path: str, content_sha256: str, progress: Progress | None = None
) -> FileImage:
    """The file image of the adapter at `path` (its registered real path), in pages of `pool`;
    AdapterError on any refusal, with nothing left allocated. `content_sha256`: what the files must
    hash to ("": not checked). `progress` counts the weights file's bytes as they are read."""
    read = _ImageRead(spec, pool, progress)
    try:
        manifest = read_manifest(
            path, spec.base, spec.max_lora_rank, spec.allowed_dirs, read_weights=read, confined=spec.confines(path)
        )
        if content_sha256 and not same_content(manifest.content_sha256, content_sha256):
            raise ChangedOnDisk(
                f"changed on disk since it was registered (content SHA-256 {short(manifest.content_sha256)}..., "
                f"registered {short(content_sha256)}...)"
            )
        check_image(read.image, read.layout, spec.slot_layout, spec.dtype)
    except BaseException:
        read.free()
        raise
    return FileImage(version_id, manifest.content_sha256, read.layout, tuple(read.extents), read.num_file_bytes)


class _ImageRead:
    """read_manifest's weights reader: plans the image, takes its pages and reads the file into them."""

    def __init__(self, spec: ReadSpec, pool: PinnedPool, progress: Progress | None) -> None:
        self.spec, self.pool, self.progress = spec, pool, progress
        self.extents: list[Extent] = []
        self.layout: ImageLayout
        self.image: ImageBytes
        self.num_file_bytes = 0  # the config's and the weights file's

    def __call__(
        self, fd: int, num_bytes: int, header: Header, modules: list[LoraModule], digest: ContentDigest
    ) -> None:
        try:
            self.layout = self.spec.slot_layout.plan(modules, header)
            self.extents = self.pool.alloc(self.layout.num_bytes)
        except (ValueError, PoolFull) as e:  # refusals of this load, not malformed files
            raise AdapterError(str(e)) from None
        self.image = ImageBytes([self.pool.view(e) for e in self.extents])
        write_tables(self.image, self.layout)
        digest.update(header.raw)  # the header's bytes as read_header read and parsed them
        on_bytes = _ignore_bytes
        if self.progress is not None:
            self.progress.set_total(num_bytes)
            self.progress.advance(header.data_offset)
            on_bytes = self.progress.advance
        data = (header.data_offset, num_bytes - header.data_offset)
        _read_data(fd, *data, self.layout, self.image, digest, on_bytes)
        self.num_file_bytes = digest.num_bytes

    def free(self) -> None:
        extents, self.extents = self.extents, []
        if extents:
            self.pool.free(extents)


def _ignore_bytes(num_bytes: int) -> None:
    """No progress to count."""


def _read_data(
    fd: int,
    data_offset: int,
    num_data: int,
    layout: ImageLayout,
    image: ImageBytes,
    digest: ContentDigest,
    on_bytes: Callable[[int], None],
) -> None:
    """Read the data region front to back: each long run straight into its pages; the rest (short
    runs, and the bytes the image does not keep) into scratch, from which the short runs are
    copied into their pages. Every chunk is hashed on a helper thread while the next one is read,
    and counted by `on_bytes` once read."""
    hasher = _Hasher(digest, on_bytes)
    try:
        done, short = 0, []
        for run in layout.runs:
            if run.stop - run.start < DIRECT_READ_BYTES:
                short.append(run)
                continue
            _read_through(fd, data_offset, (done, run.start), short, image, hasher)
            _read_into(fd, data_offset, run, image, hasher)
            done, short = run.stop, []
        _read_through(fd, data_offset, (done, num_data), short, image, hasher)
    finally:
        hasher.finish()


def _read_into(fd: int, data_offset: int, run: Run, image: ImageBytes, hasher: _Hasher) -> None:
    """Read the run's bytes straight into its pages."""
    done = run.start
    for view in image.ranges(run.offset, run.offset + run.stop - run.start):
        for chunk in view.split(READ_CHUNK_BYTES):
            pages = memoryview(chunk.numpy())
            _read_exact(fd, pages, data_offset + done)
            hasher.feed(pages)
            done += len(pages)


def _read_through(
    fd: int, data_offset: int, span: tuple[int, int], runs: list[Run], image: ImageBytes, hasher: _Hasher
) -> None:
    """Read data bytes [start, stop) into scratch, copying the runs inside them into their pages."""
    (start, stop), first = span, 0
    while start < stop:
        buffer = hasher.scratch(min(stop - start, READ_CHUNK_BYTES))
        _read_exact(fd, buffer, data_offset + start)
        hasher.feed(buffer)
        first = _keep(image, runs, first, start, buffer)
        start += len(buffer)


def _keep(image: ImageBytes, runs: list[Run], first: int, start: int, buffer: memoryview) -> int:
    """Copy the parts of runs[first:] within data bytes [start, start + len(buffer)), which `buffer`
    holds, into the image; returns the first run that goes on past them."""
    stop = start + len(buffer)
    while first < len(runs) and runs[first].start < stop:
        run = runs[first]
        lo, hi = max(run.start, start), min(run.stop, stop)
        image.put(run.offset + lo - run.start, buffer[lo - start : hi - start])
        if run.stop > stop:
            break
        first += 1
    return first


def _read_exact(fd: int, view: memoryview, offset: int) -> None:
    while len(view):
        try:
            n = os.preadv(fd, [view], offset)
        except OSError as e:
            raise AdapterError(f"{WEIGHTS_FILE} cannot be read ({type(e).__name__}).") from None
        if n == 0:
            raise AdapterError(f"{WEIGHTS_FILE} is truncated.")
        view, offset = view[n:], offset + n


class _Hasher:
    """Feeds chunks, in order, to a digest on its own thread (hashlib releases the GIL)."""

    def __init__(self, digest: ContentDigest, on_bytes: Callable[[int], None]) -> None:
        self.on_bytes = on_bytes  # each chunk's length, as it is fed
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.num_fed = 0
        self.num_hashed = 0
        self.hashed = threading.Condition()
        self.num_scratch = 0
        self.scratch_fed = [0, 0]  # per scratch buffer: the feed count once it was last fed
        self.thread = threading.Thread(target=self._run, args=(digest,), name="adapter-hash", daemon=True)
        self.thread.start()

    def feed(self, chunk: memoryview) -> None:
        self.chunks.put(chunk)
        self.num_fed += 1
        self.on_bytes(len(chunk))

    def scratch(self, num_bytes: int) -> memoryview:
        """A buffer of `num_bytes` (<= READ_CHUNK_BYTES) to read into, then feed: this thread's
        two scratch buffers in turn, each once the hash has read what it last held."""
        if not hasattr(_local, "scratch"):
            _local.scratch = [bytearray(READ_CHUNK_BYTES), bytearray(READ_CHUNK_BYTES)]
        turn = self.num_scratch % 2
        with self.hashed:
            self.hashed.wait_for(lambda: self.num_hashed >= self.scratch_fed[turn])
        self.num_scratch += 1
        self.scratch_fed[turn] = self.num_fed + 1  # the feed that follows
        return memoryview(_local.scratch[turn])[:num_bytes]

    def finish(self) -> None:
        self.chunks.put(None)
        self.thread.join()

    def _run(self, digest: ContentDigest) -> None:
        while (chunk := self.chunks.get()) is not None:
            digest.update(chunk)
            with self.hashed:
                self.num_hashed += 1
                self.hashed.notify()
