"""KV blocks: a pool with a deterministic free list, and the manager that grows and
releases each request's block table.

Prefix-cache seam: every call takes a `namespace` (0 = base model; each adapter version
will get its own). `match_prefix` is where a radix tree per namespace will answer with
already-computed blocks; today it never matches, so `num_cached_tokens` stays 0.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class BlockAccountingError(RuntimeError):
    pass


def num_blocks_for(num_tokens: int, block_size: int) -> int:
    return (num_tokens + block_size - 1) // block_size


class BlockPool:
    """Fixed set of block ids. Allocation pops from the front of the free list, freeing
    appends at the back, so the order only depends on the sequence of calls."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.owner: list[str | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    def allocate(self, num: int, owner: str) -> list[int]:
        if num > len(self.free_block_ids):
            raise BlockAccountingError(f"asked for {num} blocks, {len(self.free_block_ids)} free")
        block_ids = [self.free_block_ids.popleft() for _ in range(num)]
        for block_id in block_ids:
            self.owner[block_id] = owner
        return block_ids

    def free(self, block_ids: list[int], owner: str) -> None:
        for block_id in block_ids:
            if self.owner[block_id] != owner:
                raise BlockAccountingError(f"block {block_id} is owned by {self.owner[block_id]!r}, not {owner!r}")
            self.owner[block_id] = None
            self.free_block_ids.append(block_id)


@dataclass(frozen=True)
class PrefixMatch:
    block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def match_prefix(self, namespace: int, token_ids: list[int]) -> PrefixMatch:
        """Blocks already holding a prefix of `token_ids` in `namespace`. No reuse yet."""
        _check_namespace(namespace)
        return PrefixMatch()

    def num_new_blocks(self, block_ids: list[int], num_tokens: int) -> int:
        return max(0, num_blocks_for(num_tokens, self.block_size) - len(block_ids))

    def can_grow(self, block_ids: list[int], num_tokens: int) -> bool:
        return self.num_new_blocks(block_ids, num_tokens) <= self.pool.num_free

    def grow(self, namespace: int, req_id: str, block_ids: list[int], num_tokens: int) -> list[int]:
        """Extend `block_ids` in place so it holds `num_tokens` tokens; returns the new ids."""
        _check_namespace(namespace)
        new_block_ids = self.pool.allocate(self.num_new_blocks(block_ids, num_tokens), req_id)
        block_ids.extend(new_block_ids)
        return new_block_ids

    def release(self, namespace: int, req_id: str, block_ids: list[int]) -> None:
        """Give back a request's blocks (a prefix cache will keep full ones as reusable)."""
        _check_namespace(namespace)
        self.pool.free(block_ids, req_id)
        block_ids.clear()

    def check_integrity(self, tables: list[tuple[str, list[int]]]) -> None:
        """Raise unless free + owned == total, nothing is owned twice, and `tables` (every
        live request's block table) matches the pool's owner record exactly."""
        pool = self.pool
        free = list(pool.free_block_ids)
        seen = [False] * pool.num_blocks
        for block_id in free:
            _mark(seen, block_id, "free list")
            if pool.owner[block_id] is not None:
                raise BlockAccountingError(f"block {block_id} is free but owned by {pool.owner[block_id]!r}")
        for req_id, block_ids in tables:
            for block_id in block_ids:
                _mark(seen, block_id, req_id)
                if pool.owner[block_id] != req_id:
                    raise BlockAccountingError(f"block {block_id} in {req_id!r}'s table but owned by {pool.owner[block_id]!r}")
        num_used = sum(len(block_ids) for _, block_ids in tables)
        if len(free) + num_used != pool.num_blocks or not all(seen):
            raise BlockAccountingError(f"free {len(free)} + used {num_used} != total {pool.num_blocks}")


def _mark(seen: list[bool], block_id: int, where: str) -> None:
    if not 0 <= block_id < len(seen):
        raise BlockAccountingError(f"block id {block_id} out of range ({where})")
    if seen[block_id]:
        raise BlockAccountingError(f"block {block_id} appears twice (again in {where})")
    seen[block_id] = True


def _check_namespace(namespace: int) -> None:
    if namespace < 0:
        raise ValueError(f"namespace must be >= 0, got {namespace}")
