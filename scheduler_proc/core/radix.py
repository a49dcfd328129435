"""The prefix cache: a radix tree over full KV blocks, one virtual root per namespace.

A namespace is 0 for the base model and the adapter version id otherwise, so a reload
under the same name starts an empty tree and stale KV is never served. Each node is one
full block; its children are keyed by the next block's token ids. A node is locked while
live requests hold it (`ref_count`); holding a node means holding its whole path, so an
unlocked node's subtree is unlocked and every unlocked block is evictable, leaf first.

Block hash (what PrefixCached carries and replay checks):
    seed(namespace) = xxh64(msgpack(["ledgerserve-prefix", namespace]))
    hash(block k)   = xxh64(msgpack([hash(block k-1) or seed, token_ids of block k]))

Eviction is LRU over unlocked leaves by (last_used_step, block_id): a lazy heap whose
entries are checked against the node when popped. Dicts are lookups only; every walk
goes through sorted ids.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

_encoder = msgspec.msgpack.Encoder()
_SEED_TAG = "ledgerserve-prefix"
_MIN_LRU_ENTRIES = 16


def namespace_seed(namespace: int) -> int:
    return xxhash.xxh64_intdigest(_encoder.encode([_SEED_TAG, namespace]))


def block_hash(prev_hash: int, token_ids: list[int]) -> int:
    return xxhash.xxh64_intdigest(_encoder.encode([prev_hash, list(token_ids)]))


def chain_hashes(namespace: int, token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of every full block of `token_ids` in `namespace`."""
    hashes: list[int] = []
    prev = namespace_seed(namespace)
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = block_hash(prev, token_ids[start : start + block_size])
        hashes.append(prev)
    return hashes


@dataclass(eq=False)
class Node:
    block_id: int
    namespace: int
    parent: Node | None  # None: a child of the namespace root
    token_ids: tuple[int, ...]
    block_hash: int
    last_used_step: int
    ref_count: int = 0
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)


@dataclass(eq=False)
class Root:
    namespace: int
    seed: int
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    num_blocks: int = 0


class RadixCache:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.roots: dict[int, Root] = {}  # namespace -> root, only while it holds blocks
        self.nodes: dict[int, Node] = {}  # block id -> node
        self.evicted_namespaces: dict[int, bool] = {}  # unregistered versions: no match, no insert
        self.num_unlocked = 0
        self._lru: list[tuple[int, int]] = []  # (last_used_step, block_id), lazily checked
        self.membership = 0  # XOR of every node's _member_hash, kept as nodes come and go

    # ------------------------------------------------------------------ views

    @property
    def num_blocks(self) -> int:
        return len(self.nodes)

    def is_evicted(self, namespace: int) -> bool:
        return namespace in self.evicted_namespaces

    def namespace_block_counts(self) -> list[tuple[int, int]]:
        return [(ns, self.roots[ns].num_blocks) for ns in sorted(self.roots)]

    # ------------------------------------------------------------------ match / insert

    def match(self, namespace: int, token_ids: list[int], max_blocks: int) -> list[Node]:
        """The longest cached path of whole blocks that prefixes `token_ids`."""
        root = self.roots.get(namespace)
        if root is None or self.is_evicted(namespace):
            return []
        path: list[Node] = []
        children = root.children
        for k in range(max_blocks):
            node = children.get(tuple(token_ids[k * self.block_size : (k + 1) * self.block_size]))
            if node is None:
                break
            path.append(node)
            children = node.children
        return path

    def insert(
        self, namespace: int, parent: Node | None, token_ids: list[int], block_id: int, step: int
    ) -> Node | None:
        """Add `block_id` (full, computed) under `parent`, locked once for its inserter.
        None if the namespace is evicted or these tokens are already cached there."""
        if self.is_evicted(namespace) or block_id in self.nodes:
            return None
        root = self.roots.get(namespace)
        if root is None:
            root = self.roots[namespace] = Root(namespace, namespace_seed(namespace))
        children = root.children if parent is None else parent.children
        key = tuple(token_ids)
        if key in children:
            return None
        prev = root.seed if parent is None else parent.block_hash
        node = Node(block_id, namespace, parent, key, block_hash(prev, token_ids), step, ref_count=1)
        children[key] = node
        self.nodes[block_id] = node
        self.membership ^= _member_hash(node)
        root.num_blocks += 1
        return node

    # ------------------------------------------------------------------ locks

    def lock(self, path: list[Node], step: int) -> None:
        for node in path:
            if node.ref_count == 0:
                self.num_unlocked -= 1
            node.ref_count += 1
            node.last_used_step = step

    def unlock(self, path: list[Node], step: int) -> list[int]:
        """Drop one hold on each node, deepest first; returns the blocks freed because
        their namespace was evicted while they were locked."""
        freed: list[int] = []
        for node in reversed(path):
            if node.ref_count <= 0:
                raise RuntimeError(f"block {node.block_id} unlocked more often than locked")
            node.ref_count -= 1
            node.last_used_step = step
            if node.ref_count > 0:
                continue
            if self.is_evicted(node.namespace):
                self._remove(node)
                freed.append(node.block_id)
            else:
                self.num_unlocked += 1
                self._push_if_leaf(node)
        return freed

    # ------------------------------------------------------------------ eviction

    def evict_lru(self) -> int:
        """Remove the least recently used unlocked leaf; returns its block id."""
        while self._lru:
            step, block_id = heapq.heappop(self._lru)
            node = self.nodes.get(block_id)
            if node is None or node.children or node.ref_count or node.last_used_step != step:
                continue  # a stale entry
            self.num_unlocked -= 1
            self._remove(node)
            return block_id
        raise RuntimeError("no unlocked cached block to evict")

    def evict_namespace(self, namespace: int) -> tuple[list[int], int]:
        """Evict every unlocked block of `namespace` at once and bar it from the cache;
        returns (freed block ids, number still locked)."""
        self.evicted_namespaces[namespace] = True
        root = self.roots.get(namespace)
        if root is None:
            return [], 0
        nodes = _subtree(root.children)
        unlocked = [node for node in nodes if node.ref_count == 0]
        for node in reversed(unlocked):  # children before parents
            self.num_unlocked -= 1
            self._remove(node)
        return sorted(node.block_id for node in unlocked), len(nodes) - len(unlocked)

    def forget_namespace(self, namespace: int) -> None:
        """An evicted namespace that holds no block and that no request can reach again (its
        version is dropped) leaves the cache's state, so that state stays O(live namespaces)."""
        if namespace in self.roots:
            raise RuntimeError(
                f"namespace {namespace} forgotten while it holds {self.roots[namespace].num_blocks} blocks"
            )
        del self.evicted_namespaces[namespace]

    def _remove(self, node: Node) -> None:
        if node.children:
            raise RuntimeError(f"block {node.block_id} removed while it has children")
        root = self.roots[node.namespace]
        siblings = root.children if node.parent is None else node.parent.children
        del siblings[node.token_ids]
        del self.nodes[node.block_id]
        self.membership ^= _member_hash(node)
        root.num_blocks -= 1
        if root.num_blocks == 0:
            del self.roots[node.namespace]
        if node.parent is not None and node.parent.ref_count == 0:
            self._push_if_leaf(node.parent)

    def _push_if_leaf(self, node: Node) -> None:
        if node.children:
            return
        heapq.heappush(self._lru, (node.last_used_step, node.block_id))
        if len(self._lru) > 4 * max(len(self.nodes), _MIN_LRU_ENTRIES):
            self._rebuild_lru()

    def _rebuild_lru(self) -> None:
        """Drop stale entries (each unlock pushes one), keeping the heap O(cached blocks)."""
        self._lru = [
            (node.last_used_step, node.block_id)
            for node in (self.nodes[b] for b in sorted(self.nodes))
            if not node.children and node.ref_count == 0
        ]
        heapq.heapify(self._lru)

    # ------------------------------------------------------------------ encoding

    def rows(self) -> list[Any]:
        """Canonical encoding for the StateDigest, O(live namespaces) per step: block counts
        per namespace, the set of nodes (block, namespace, parent, hash) as an order-free
        XOR kept up to date on insert and evict, the lock count, and the evicted namespaces
        not yet forgotten (those whose version live requests still hold).
        Recency is left out: it only matters through eviction choices, which are logged."""
        return [
            [[ns, self.roots[ns].num_blocks] for ns in sorted(self.roots)],
            self.membership,
            self.num_unlocked,
            sorted(self.evicted_namespaces),
        ]


def _member_hash(node: Node) -> int:
    parent = -1 if node.parent is None else node.parent.block_id
    return xxhash.xxh64_intdigest(_encoder.encode([node.block_id, node.namespace, parent, node.block_hash]))


def _subtree(children: dict[tuple[int, ...], Node]) -> list[Node]:
    """Every node below `children`, parents before children, siblings by block id."""
    out: list[Node] = []
    stack = sorted(children.values(), key=lambda n: n.block_id, reverse=True)
    while stack:
        node = stack.pop()
        out.append(node)
        stack.extend(sorted(node.children.values(), key=lambda n: n.block_id, reverse=True))
    return out
