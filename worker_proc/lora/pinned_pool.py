"""The CPU tier's memory: a few large (pinned, on CUDA) blocks split into fixed-size pages.

Blocks are allocated lazily, up to a bound, and kept: pinning is slow, so a block once
pinned serves every later adapter. An allocation takes pages in runs that are contiguous
inside one block (the longest runs first), so an adapter's image is a handful of extents
and moves to the GPU in a handful of copies. Thread-safe: loader threads allocate, the
worker's main thread frees.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

PAGE_BYTES = 2 << 20
BLOCK_BYTES = 128 << 20
MIN_PAGE_BYTES = 64 << 10


class PoolFull(Exception):
    """No room for an image within the pool's bound."""


@dataclass(frozen=True)
class Extent:
    block: int
    first_page: int
    num_pages: int


def page_bytes_for(max_image_bytes: int) -> int:
    """PAGE_BYTES, or smaller pages (a power of two, >= MIN_PAGE_BYTES) for small adapters."""
    size = MIN_PAGE_BYTES
    while size < PAGE_BYTES and size * 8 < max_image_bytes:
        size *= 2
    return size


class PinnedPool:
    def __init__(self, max_bytes: int, page_bytes: int, pin: bool, block_bytes: int = BLOCK_BYTES) -> None:
        if max_bytes <= 0 or page_bytes <= 0:
            raise ValueError("the pool needs a positive bound and page size")
        self.page_bytes = page_bytes
        self.pages_per_block = max(1, min(block_bytes, max_bytes) // page_bytes)
        self.max_blocks = -(-max_bytes // (self.pages_per_block * page_bytes))
        self.pin = pin
        self.blocks: list[torch.Tensor] = []  # [pages_per_block * page_bytes] uint8 each
        self.free_pages: list[list[bool]] = []  # per block, per page
        self._lock = threading.Lock()

    @property
    def num_used_pages(self) -> int:
        with self._lock:
            return sum(free.count(False) for free in self.free_pages)

    def alloc(self, num_bytes: int) -> list[Extent]:
        """Extents covering `num_bytes`, or PoolFull (nothing is taken then)."""
        num_pages = max(1, -(-num_bytes // self.page_bytes))
        with self._lock:
            taken: list[Extent] = []
            while num_pages > 0:
                run = self._longest_free_run()
                if run is None or run.num_pages < num_pages:  # prefer one whole run in a new block
                    run = self._new_block_run() or run
                if run is None:
                    for extent in taken:
                        self._mark(extent, True)
                    raise PoolFull(
                        f"the CPU tier is full ({len(self.blocks)} blocks of "
                        f"{self.pages_per_block * self.page_bytes} bytes)"
                    )
                extent = Extent(run.block, run.first_page, min(run.num_pages, num_pages))
                self._mark(extent, False)
                taken.append(extent)
                num_pages -= extent.num_pages
            return taken

    def free(self, extents: list[Extent]) -> None:
        with self._lock:
            for extent in extents:
                self._mark(extent, True)

    def view(self, extent: Extent) -> torch.Tensor:
        """The extent's bytes: [num_pages * page_bytes] uint8."""
        start = extent.first_page * self.page_bytes
        return self.blocks[extent.block][start : start + extent.num_pages * self.page_bytes]

    def _longest_free_run(self) -> Extent | None:
        best: Extent | None = None
        for block, free in enumerate(self.free_pages):
            page = 0
            while page < len(free):
                if not free[page]:
                    page += 1
                    continue
                end = page
                while end < len(free) and free[end]:
                    end += 1
                if best is None or end - page > best.num_pages:
                    best = Extent(block, page, end - page)
                page = end
        return best

    def _new_block_run(self) -> Extent | None:
        if len(self.blocks) >= self.max_blocks:
            return None
        num_bytes = self.pages_per_block * self.page_bytes
        self.blocks.append(torch.empty(num_bytes, dtype=torch.uint8, pin_memory=self.pin))
        self.free_pages.append([True] * self.pages_per_block)
        return Extent(len(self.blocks) - 1, 0, self.pages_per_block)

    def _mark(self, extent: Extent, free: bool) -> None:
        pages = self.free_pages[extent.block]
        for page in range(extent.first_page, extent.first_page + extent.num_pages):
            if pages[page] == free:
                raise RuntimeError(f"page {page} of block {extent.block} is already {'free' if free else 'taken'}")
            pages[page] = free
