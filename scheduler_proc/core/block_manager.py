"""KV blocks: a pool with a deterministic free list, and the manager that grows and
releases each request's block table on top of the prefix cache (radix.py).

A block is in exactly one of three places: the free list, the prefix cache (a radix
node, shared and locked by the requests holding it), or one request's private tail.
A request's table is its cached prefix (`req.num_shared_blocks` locked nodes) followed
by private blocks. Allocation takes free blocks first, then evicts unlocked cached
leaves (LRU); callers preempt only when neither is possible.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from functools import reduce

import xxhash

from ledgerserve.scheduler_proc.core.integrity import BlockAccountingError, check_blocks
from ledgerserve.scheduler_proc.core.radix import Node, RadixCache
from ledgerserve.scheduler_proc.core.request import Request

__all__ = ["BlockAccounting", "BlockAccountingError", "BlockManager", "BlockPool", "PrefixMatch", "num_blocks_for"]


def _id_hash(block_id: int) -> int:
    return xxhash.xxh64_intdigest(block_id.to_bytes(8, "little"))


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockPool:
    """Fixed set of block ids. Allocation pops from the front of the free list, freeing
    appends at the back, so the order only depends on the sequence of calls. `owner`
    names the request holding a private block; cached and free blocks have none."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.owner: list[str | None] = [None] * num_blocks
        # XOR of _id_hash over the free list, kept up to date: the StateDigest's O(1)
        # view of which blocks are free (their order shows in the logged block tables).
        self.free_membership = reduce(lambda acc, b: acc ^ _id_hash(b), range(num_blocks), 0)

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def take(self, block_id: int, owner: str) -> None:
        if self.owner[block_id] is not None:
            raise BlockAccountingError(f"block {block_id} is already owned by {self.owner[block_id]!r}")
        self.owner[block_id] = owner

    def allocate_free(self, owner: str) -> int:
        if not self.free_block_ids:
            raise BlockAccountingError("no free block")
        block_id = self.free_block_ids.popleft()
        self.free_membership ^= _id_hash(block_id)
        self.take(block_id, owner)
        return block_id

    def disown(self, block_id: int, owner: str) -> None:
        if self.owner[block_id] != owner:
            raise BlockAccountingError(f"block {block_id} is owned by {self.owner[block_id]!r}, not {owner!r}")
        self.owner[block_id] = None

    def free(self, block_ids: list[int], owner: str | None) -> None:
        for block_id in block_ids:
            if owner is not None:
                self.disown(block_id, owner)
            elif self.owner[block_id] is not None:
                raise BlockAccountingError(f"cached block {block_id} is owned by {self.owner[block_id]!r}")
            self.free_block_ids.append(block_id)
            self.free_membership ^= _id_hash(block_id)


@dataclass(frozen=True)
class PrefixMatch:
    nodes: list[Node] = field(default_factory=list)
    num_cached_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [node.block_id for node in self.nodes]


@dataclass(frozen=True)
class BlockAccounting:
    num_total: int
    num_free: int
    num_cached: int  # in the prefix cache, locked or not
    num_locked: int  # cached blocks some live request holds
    num_private: int  # held by one live request, not cached


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(block_size)
        self.paths: dict[str, list[Node]] = {}  # req id -> the cached nodes it holds (lookups)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.pool.num_free + self.cache.num_unlocked

    # ------------------------------------------------------------------ admission

    def match_prefix(self, namespace: int, token_ids: list[int]) -> PrefixMatch:
        """Cached whole blocks that prefix `token_ids` in `namespace`, leaving at least one
        token to compute so the request samples. Pure: locks nothing."""
        _check_namespace(namespace)
        max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
        nodes = self.cache.match(namespace, token_ids, max_blocks)
        return PrefixMatch(nodes, len(nodes) * self.block_size)

    def can_admit(self, match: PrefixMatch, num_tokens: int) -> bool:
        """Room for a request holding `match` to reach `num_tokens` tokens."""
        num_new = max(0, num_blocks_for(num_tokens, self.block_size) - len(match.nodes))
        num_matched_unlocked = sum(1 for node in match.nodes if node.ref_count == 0)
        return num_new <= self.num_available_blocks - num_matched_unlocked

    def admit(self, req: Request, match: PrefixMatch, step: int) -> None:
        """Lock the matched prefix and start the request's table with it."""
        if req.block_ids:
            raise BlockAccountingError(f"{req.req_id!r} already holds blocks")
        self.cache.lock(match.nodes, step)
        self.paths[req.req_id] = list(match.nodes)
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = match.num_cached_tokens
        req.num_shared_blocks = len(match.nodes)

    # ------------------------------------------------------------------ growth

    def num_new_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_ids, num_tokens) <= self.num_available_blocks

    def grow(self, namespace: int, req_id: str, block_ids: list[int], num_tokens: int) -> list[int]:
        """Extend `block_ids` in place so it holds `num_tokens` tokens; returns the new ids.
        Free blocks first, then the least recently used unlocked cached leaves."""
        _check_namespace(namespace)
        num_new = self.num_new_blocks(block_ids, num_tokens)
        if num_new > self.num_available_blocks:
            raise BlockAccountingError(f"asked for {num_new} blocks, {self.num_available_blocks} available")
        new_block_ids = [self._allocate(req_id) for _ in range(num_new)]
        block_ids.extend(new_block_ids)
        return new_block_ids

    def _allocate(self, req_id: str) -> int:
        if self.pool.num_free:
            return self.pool.allocate_free(req_id)
        block_id = self.cache.evict_lru()
        self.pool.take(block_id, req_id)
        return block_id

    # ------------------------------------------------------------------ caching

    def cache_computed(self, req: Request, step: int) -> tuple[list[int], list[int]]:
        """Insert the request's newly completed blocks into its namespace's tree; returns
        their (block ids, hashes). Stops at a block whose tokens another block already
        caches there (the request keeps its own copy private)."""
        path = self.paths.setdefault(req.req_id, [])
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        block_ids: list[int] = []
        hashes: list[int] = []
        for k in range(len(path), num_full):
            parent = path[-1] if path else None
            block_id = req.block_ids[k]
            tokens = req.token_ids_between(k * self.block_size, (k + 1) * self.block_size)
            node = self.cache.insert(req.namespace, parent, tokens, block_id, step)
            if node is None:
                break
            self.pool.disown(block_id, req.req_id)
            path.append(node)
            block_ids.append(block_id)
            hashes.append(node.block_hash)
        req.num_shared_blocks = len(path)
        return block_ids, hashes

    # ------------------------------------------------------------------ release

    def release(self, namespace: int, req_id: str, block_ids: list[int], step: int = 0) -> None:
        """Give back a request's blocks: cached ones are unlocked (and stay reusable unless
        their namespace was evicted), private ones go back to the free list."""
        _check_namespace(namespace)
        path = self.paths.pop(req_id, [])
        if block_ids[: len(path)] != [node.block_id for node in path]:
            raise BlockAccountingError(f"{req_id!r}'s table does not start with its cached path")
        self.pool.free(self.cache.unlock(path, step), None)
        self.pool.free(block_ids[len(path) :], req_id)
        block_ids.clear()

    def evict_namespace(self, namespace: int) -> tuple[int, int]:
        """Evict an unloaded version's unlocked blocks now; locked ones are freed as their
        requests release them. Returns (num evicted, num still locked)."""
        freed, num_locked = self.cache.evict_namespace(namespace)
        self.pool.free(freed, None)
        return len(freed), num_locked

    # ------------------------------------------------------------------ checks and views

    def namespace_block_counts(self) -> list[tuple[int, int]]:
        return self.cache.namespace_block_counts()

    def block_accounting(self) -> BlockAccounting:
        num_locked = sum(1 for b in sorted(self.cache.nodes) if self.cache.nodes[b].ref_count > 0)
        num_private = sum(1 for owner in self.pool.owner if owner is not None)
        return BlockAccounting(self.pool.num_blocks, self.pool.num_free, self.cache.num_blocks, num_locked, num_private)

    def check_integrity(self, tables: list[tuple[str, list[int]]]) -> None:
        """Raise unless every block is in exactly one of free / cached / one live
        request's private tail, `tables` match the pool's owners and the cache's locks,
        and free + cached + private == total."""
        check_blocks(self.pool.owner, list(self.pool.free_block_ids), self.cache.nodes, self.paths, tables)


def _check_namespace(namespace: int) -> None:
    if namespace < 0:
        raise ValueError(f"namespace must be >= 0, got {namespace}")
