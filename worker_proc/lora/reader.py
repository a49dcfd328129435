"""Disk -> CPU tier: one adapter version read, checked and converted into a slot image.

The files are checked by the bounded reader (`read_manifest`: containment, config, header,
shapes), then read whole with positional reads into a reusable per-thread buffer (no
per-tensor allocation, nothing unpickled) while they are hashed: the config's bytes, then
the weights file's. A version registered with a content digest must hash the same, or the
load fails. Every tensor is converted into the image (worker_proc/lora/image_fill.py) as soon
as its bytes are in. Runs on a loader thread: the reads, the hash and the torch ops release
the GIL.
"""

from __future__ import annotations

import os
import queue
import threading
from dataclasses import dataclass

import torch

from shared.adapter_config import CONFIG_MAX_BYTES
from shared.adapter_digest import ContentDigest
from shared.adapter_files import file_size, is_inside, open_file, read_at
from shared.adapter_format import CONFIG_FILE, WEIGHTS_FILE, AdapterError, BaseShapes, max_tensors, read_manifest
from shared.safetensors_header import read_header
from worker_proc.lora.image_fill import ImageFiller
from worker_proc.lora.pinned_pool import Extent, PinnedPool
from worker_proc.lora.slot_image import ImageBytes, ImageLayout, SlotLayout

READ_CHUNK_BYTES = 16 << 20
_local = threading.local()  # each thread's reusable read buffer


class ChangedOnDisk(AdapterError):
    """The files no longer hash to the version's registered content digest."""


@dataclass(frozen=True)
class ReadSpec:
    """What every read of this worker checks against."""

    base: BaseShapes
    max_lora_rank: int
    allowed_dirs: tuple[str, ...]
    slot_layout: SlotLayout
    dtype: torch.dtype


@dataclass(frozen=True)
class SlotImage:
    version_id: int
    content_digest: int  # as read (the registered one when it was given)
    layout: ImageLayout
    extents: tuple[Extent, ...]
    num_file_bytes: int  # bytes read from disk


def read_image(spec: ReadSpec, pool: PinnedPool, version_id: int, path: str, content_digest: int) -> SlotImage:
    """The slot image of the adapter at `path`, in pages of `pool`; AdapterError (or
    ValueError, PoolFull) on any refusal, with nothing left allocated."""
    manifest = read_manifest(path, spec.base, spec.max_lora_rank, spec.allowed_dirs)
    layout = spec.slot_layout.plan(manifest, spec.dtype)
    roots = spec.allowed_dirs if is_inside(manifest.path, spec.allowed_dirs) else ()
    digest = ContentDigest()
    num_config_bytes = _hash_config(manifest.path, roots, digest)
    fd, _ = open_file(manifest.path, WEIGHTS_FILE, roots)
    try:
        num_bytes = file_size(fd)
        header = read_header(fd, num_bytes, max_tensors(spec.base))
        extents = pool.alloc(layout.num_bytes)
        try:
            image = ImageBytes([pool.view(e) for e in extents])
            _read_into(fd, num_bytes, digest, ImageFiller(image, layout, spec.slot_layout, header,
                                                          _buffer(num_bytes - header.data_offset)))
            if content_digest and digest.value != content_digest:
                raise ChangedOnDisk(f"changed on disk since it was registered (content digest "
                                    f"{digest.value:#018x}, registered {content_digest:#018x})")
        except BaseException:
            pool.free(extents)
            raise
    finally:
        os.close(fd)
    return SlotImage(version_id, digest.value, layout, tuple(extents), num_config_bytes + num_bytes)


def _hash_config(directory: str, roots: tuple[str, ...], digest: ContentDigest) -> int:
    fd, _ = open_file(directory, CONFIG_FILE, roots)
    try:
        num_bytes = file_size(fd)
        if num_bytes > CONFIG_MAX_BYTES:
            raise AdapterError(f"{CONFIG_FILE} is {num_bytes} bytes; at most {CONFIG_MAX_BYTES} are read.")
        digest.update(read_at(fd, 0, num_bytes, CONFIG_FILE))
    finally:
        os.close(fd)
    return num_bytes


def _read_into(fd: int, num_bytes: int, digest: ContentDigest, filler: ImageFiller) -> None:
    """Hash the whole file and fill the image from its data section, read into this thread's
    buffer: each chunk is hashed on a helper thread, and the tensors it completes converted on
    the fill threads, while the next chunk is read."""
    data_offset = filler.header.data_offset
    digest.update(read_at(fd, 0, data_offset, WEIGHTS_FILE))  # the header (bounded by read_header)
    num_data = num_bytes - data_offset
    view = memoryview(filler.data.numpy())
    hasher = _Hasher(digest)
    try:
        done = 0
        while done < num_data:
            chunk = view[done : min(num_data, done + READ_CHUNK_BYTES)]
            try:
                n = os.preadv(fd, [chunk], data_offset + done)
            except OSError as e:
                raise AdapterError(f"{WEIGHTS_FILE} cannot be read ({type(e).__name__}).") from None
            if n == 0:
                raise AdapterError(f"{WEIGHTS_FILE} is truncated.")
            hasher.feed(chunk[:n])
            done += n
            filler.arrived(done)
    except BaseException:
        hasher.finish()
        filler.abandon()
        raise
    hasher.finish()
    filler.finish()


class _Hasher:
    """Feeds chunks, in order, to a digest on its own thread (xxhash releases the GIL)."""

    def __init__(self, digest: ContentDigest) -> None:
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(digest,), name="adapter-hash", daemon=True)
        self.thread.start()

    def feed(self, chunk: memoryview) -> None:
        self.chunks.put(chunk)

    def finish(self) -> None:
        self.chunks.put(None)
        self.thread.join()

    def _run(self, digest: ContentDigest) -> None:
        while (chunk := self.chunks.get()) is not None:
            digest.update(chunk)


def _buffer(num_bytes: int) -> torch.Tensor:
    """This thread's read buffer, grown (to a power of two) when too small: [num_bytes] uint8."""
    buffer: torch.Tensor | None = getattr(_local, "buffer", None)
    if buffer is None or buffer.numel() < num_bytes:
        size = 1 << max(20, (num_bytes - 1).bit_length())
        buffer = torch.empty(size, dtype=torch.uint8)
        _local.buffer = buffer
    return buffer[:num_bytes]
