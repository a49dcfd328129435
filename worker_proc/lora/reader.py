"""Disk -> CPU tier: one adapter version read, checked and kept as its file image
(worker_proc/lora/file_image.py): this rank's shard of each tensor the adapter uses.

The bounded reader (`read_manifest`: containment, config, header, shapes) opens and checks the
files, and hands the open weights file to `_ImageRead`, which reads it front to back with
positional reads (nothing converted on the host, nothing unpickled) while a helper thread hashes
every byte of it after the config's: each rank reads and hashes the whole file, so each checks
the version's content digest, but keeps only its shard. A long run of kept bytes (a whole tensor
or more, with one rank) is read straight into the image's pool pages; everything else is read
through a small scratch buffer, and the kept ranges in it (a shard's rows of B, the rows of its
columns of A) are copied into the pages. A version registered with a content digest must hash
the same, or the load fails: bytes that hash the same are the bytes the HTTP process checked at
registration (finite, and finite in the model dtype), so they are not checked again. A read
without a registered digest (0) checks the values it keeps here. Runs on a loader thread: the
reads and the hash release the GIL, and a load takes it a few times per chunk read.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ledgerserve.shared.adapter_digest import ContentDigest
from ledgerserve.shared.adapter_files import read_at
from ledgerserve.shared.adapter_format import WEIGHTS_FILE, AdapterError, BaseShapes, LoraModule, read_manifest
from ledgerserve.shared.progress import Progress
from ledgerserve.shared.safetensors_header import Header, value_problem
from ledgerserve.worker_proc.lora.file_image import FileTensor, ImageBytes, ImageLayout, Run, SlotLayout, write_tables
from ledgerserve.worker_proc.lora.pinned_pool import Extent, PinnedPool, PoolFull

READ_CHUNK_BYTES = 16 << 20  # one positional read; the hash of a chunk runs beside the next read
DIRECT_READ_BYTES = 1 << 20  # a run this long is read straight into its pages, a shorter one through scratch
CHECK_CHUNK_BYTES = 4 << 20  # an unverified read's value check looks at this much at a time
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
    dtype: torch.dtype  # the model's: an unverified read's values must be finite in it


@dataclass(frozen=True)
class FileImage:
    version_id: int
    content_digest: int  # as read (the registered one when it was given)
    layout: ImageLayout
    extents: tuple[Extent, ...]
    num_file_bytes: int  # bytes read from disk


def read_image(
    spec: ReadSpec, pool: PinnedPool, version_id: int, path: str, content_digest: int, progress: Progress | None = None
) -> FileImage:
    """The file image of the adapter at `path`, in pages of `pool`; AdapterError on any refusal,
    with nothing left allocated. `progress` counts the weights file's bytes as they are read."""
    read = _ImageRead(spec, pool, progress)
    try:
        manifest = read_manifest(path, spec.base, spec.max_lora_rank, spec.allowed_dirs, read_weights=read)
        if content_digest and manifest.content_digest != content_digest:
            raise ChangedOnDisk(
                f"changed on disk since it was registered (content digest "
                f"{manifest.content_digest:#018x}, registered {content_digest:#018x})"
            )
        if not content_digest:
            _check_values(read.image, read.layout, spec.dtype)
    except BaseException:
        read.free()
        raise
    return FileImage(version_id, manifest.content_digest, read.layout, tuple(read.extents), read.num_file_bytes)


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
        digest.update(read_at(fd, 0, header.data_offset, WEIGHTS_FILE))  # the header (bounded by read_header)
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


def _check_values(image: ImageBytes, layout: ImageLayout, dtype: torch.dtype) -> None:
    """An unverified read: every used tensor must be finite in the model dtype (AdapterError)."""
    model_dtype = str(dtype).removeprefix("torch.")
    for piece in layout.pieces:
        for tensor in (piece.a, piece.b):
            if not _finite(image, tensor, model_dtype):
                raise AdapterError("the adapter's weights hold NaN or infinite values (in the model's dtype).")


def _finite(image: ImageBytes, tensor: FileTensor, model_dtype: str) -> bool:
    step = CHECK_CHUNK_BYTES - CHECK_CHUNK_BYTES % tensor.torch_dtype.itemsize
    stop = tensor.offset + tensor.num_bytes
    for start in range(tensor.offset, stop, step):
        views = image.ranges(start, min(stop, start + step))
        chunk = views[0] if len(views) == 1 else torch.cat(views)  # [n] uint8, whole values
        if value_problem(memoryview(chunk.numpy()), tensor.dtype, model_dtype):
            return False
    return True


class _Hasher:
    """Feeds chunks, in order, to a digest on its own thread (xxhash releases the GIL)."""

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
