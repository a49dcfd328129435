"""The core's prefix-cache decisions: PrefixCached when a request's computed blocks
enter its namespace's tree, NamespaceEvicted when an adapter version is unregistered,
and forgetting an evicted namespace once its version is dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ledgerserve.scheduler_proc.core.block_manager import BlockManager
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.shared import events as ev


def cache_computed(block_manager: BlockManager, req: Request, step: int) -> Decisions:
    block_ids, block_hashes = block_manager.cache_computed(req, step)
    if not block_ids:
        return []
    return [ev.PrefixCached(req.req_id, req.namespace, block_ids, block_hashes)]


def unregistered_versions(decisions: Decisions) -> list[int]:
    """Adapter versions these adapter decisions unregister: an unload (or failed load),
    or a load_inplace superseding the previous version under the name."""
    out: list[int] = []
    for decision in decisions:
        if isinstance(decision, ev.AdapterUnloaded):
            out.append(decision.version_id)
        elif isinstance(decision, ev.AdapterRegistered) and decision.replaced_version_id:
            out.append(decision.replaced_version_id)
    return out


def evict_namespaces(block_manager: BlockManager, version_ids: list[int]) -> Decisions:
    decisions: Decisions = []
    for version_id in version_ids:
        num_blocks, num_locked = block_manager.evict_namespace(version_id)
        decisions.append(ev.NamespaceEvicted(version_id, num_blocks, num_locked))
    return decisions


def forget_dropped_namespaces(block_manager: BlockManager, live_versions: Mapping[int, Any]) -> None:
    """An evicted namespace leaves the prefix cache's state once its version is dropped (not
    in `live_versions`: no live request holds it, and version ids are never reused) and it
    holds no block, so the state stays O(live). Walks only the namespaces still barred."""
    cache = block_manager.cache
    for namespace in sorted(cache.evicted_namespaces):
        if namespace not in live_versions and namespace not in cache.roots:
            cache.forget_namespace(namespace)


def before_reply(decisions: Decisions, inserted: Decisions) -> Decisions:
    """`inserted` placed just before the op's AdapterOpReplied (or at the end)."""
    for i, decision in enumerate(decisions):
        if isinstance(decision, ev.AdapterOpReplied):
            return decisions[:i] + inserted + decisions[i:]
    return decisions + inserted
