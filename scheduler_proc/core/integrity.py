"""Block accounting checks: pure functions over the pool's owners, the free list, the
prefix cache's nodes and each live request's table."""

from __future__ import annotations

from typing import Any


class BlockAccountingError(RuntimeError):
    pass


def check_blocks(
    owner: list[str | None],
    free: list[int],
    nodes: dict[int, Any],
    paths: dict[str, list[Any]],
    tables: list[tuple[str, list[int]]],
) -> None:
    """Every block is in exactly one of: the free list, the cache, one request's private
    tail; each table is its locked cached path then blocks it owns; every node's
    ref_count is the number of tables holding it; free + cached + private == total."""
    num_total = len(owner)
    seen = [""] * num_total
    for block_id in free:
        _mark(seen, block_id, "the free list")
        if owner[block_id] is not None:
            raise BlockAccountingError(f"block {block_id} is free but owned by {owner[block_id]!r}")
    for block_id in sorted(nodes):
        _mark(seen, block_id, "the prefix cache")
        if owner[block_id] is not None:
            raise BlockAccountingError(f"cached block {block_id} is also owned by {owner[block_id]!r}")
    num_refs: dict[int, int] = {}
    num_private = 0
    for req_id, block_ids in tables:
        path = [node.block_id for node in paths.get(req_id, [])]
        if block_ids[: len(path)] != path:
            raise BlockAccountingError(f"{req_id!r}'s table {block_ids} does not start with its cached path {path}")
        for block_id in path:
            num_refs[block_id] = num_refs.get(block_id, 0) + 1
        for block_id in block_ids[len(path) :]:
            _mark(seen, block_id, req_id)
            if owner[block_id] != req_id:
                raise BlockAccountingError(f"block {block_id} in {req_id!r}'s table but owned by {owner[block_id]!r}")
            num_private += 1
    _check_refs(nodes, num_refs)
    _check_paths(paths, tables)
    if len(free) + len(nodes) + num_private != num_total or not all(seen):
        raise BlockAccountingError(
            f"free {len(free)} + cached {len(nodes)} + private {num_private} != total {num_total}"
        )


def _check_refs(nodes: dict[int, Any], num_refs: dict[int, int]) -> None:
    for block_id in sorted(nodes):
        node = nodes[block_id]
        if node.ref_count != num_refs.get(block_id, 0):
            raise BlockAccountingError(
                f"cached block {block_id} has ref_count {node.ref_count}, {num_refs.get(block_id, 0)} tables hold it"
            )
        if node.parent is not None and node.parent.ref_count < node.ref_count:
            raise BlockAccountingError(
                f"cached block {block_id} is held more often than its parent {node.parent.block_id}"
            )
    for block_id in sorted(num_refs):
        if block_id not in nodes:
            raise BlockAccountingError(f"block {block_id} is in a cached path but not in the cache")


def _check_paths(paths: dict[str, list[Any]], tables: list[tuple[str, list[int]]]) -> None:
    live = [req_id for req_id, _ in tables]
    for req_id in sorted(paths):
        if req_id not in live:
            raise BlockAccountingError(f"{req_id!r} holds a cached path but is not live")


def _mark(seen: list[str], block_id: int, where: str) -> None:
    if not 0 <= block_id < len(seen):
        raise BlockAccountingError(f"block id {block_id} out of range ({where})")
    if seen[block_id]:
        raise BlockAccountingError(f"block {block_id} is in {seen[block_id]} and again in {where}")
    seen[block_id] = where
