"""What moving adapter bytes can cost on this machine: pinned host-to-device copy bandwidth
(torch, CUDA only) and file-read bandwidth from the page cache (a large file written, read
once to warm the cache, then timed)."""

from __future__ import annotations

import os
import time

import torch

READ_CHUNK_BYTES = 8 << 20


def pinned_h2d_gbps(num_bytes: int = 1 << 30, iters: int = 5) -> float | None:
    """Pinned CPU -> GPU copy bandwidth in GB/s (bytes moved / time); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)  # [num_bytes]
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")  # [num_bytes]
    dst.copy_(src, non_blocking=True)  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return num_bytes * iters / (start.elapsed_time(end) / 1e3) / 1e9


def page_cache_read_gbps(directory: str, num_bytes: int = 1 << 30, iters: int = 3) -> float:
    """Read bandwidth in GB/s of a `num_bytes` file in `directory` that sits in the page
    cache (written, then read once before the timed reads); the file is removed after."""
    path = os.path.join(directory, "read-bandwidth.bin")
    block = os.urandom(READ_CHUNK_BYTES)
    with open(path, "wb") as f:
        for _ in range(num_bytes // READ_CHUNK_BYTES):
            f.write(block)
    try:
        size = os.path.getsize(path)
        _read_all(path)
        start = time.perf_counter()
        for _ in range(iters):
            _read_all(path)
        return size * iters / (time.perf_counter() - start) / 1e9
    finally:
        os.remove(path)


def _read_all(path: str) -> int:
    buffer = bytearray(READ_CHUNK_BYTES)
    view = memoryview(buffer)
    num_read = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            num_read += n
    return num_read
