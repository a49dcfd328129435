"""The bounds on marked adapter versions, checked at registration.

User pins (AdapterLoadRequested.pinned): at most max_loras - 1 registered versions, so other
adapters can still run; one more is refused with 400 naming the bound.

Adapters registered on demand: the HTTP process loaded them because a request named them
(AdapterLoadRequested.on_demand). At most `max_on_demand_loras` are registered at once.
Registering one more past that unregisters the least recently used IDLE one (no waiting or
running request holds it) as a logged AdapterUnloaded with reason "lru"; when every one is
in use, the new load is refused with 503. "Used" is a logical clock (AdapterManager.num_uses)
that ticks at each on-demand registration and each RequestArrived naming an on-demand
version; no two versions share a value, so the choice needs no tie-break beyond it.
Adapters loaded explicitly or at start-up are never chosen. Pure reads of the manager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerserve.shared import events as ev

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.adapters import AdapterManager, AdapterVersion

LRU_REASON = "lru"


def registered(manager: AdapterManager, replaced_version_id: int = 0) -> list[AdapterVersion]:
    """The registered on-demand versions, by id, but the one a load_inplace replaces."""
    return [
        manager.versions[v]
        for v in sorted(manager.versions)
        if manager.versions[v].on_demand and manager.versions[v].is_registered and v != replaced_version_id
    ]


def is_full(manager: AdapterManager, replaced_version_id: int = 0) -> bool:
    return len(registered(manager, replaced_version_id)) >= manager.config.max_on_demand_loras


def lru_idle(manager: AdapterManager, replaced_version_id: int = 0) -> AdapterVersion | None:
    """The registered on-demand version, not user-pinned, that no live request holds and that
    was used longest ago."""
    idle = [v for v in registered(manager, replaced_version_id) if v.num_reqs == 0 and not v.pinned]
    return min(idle, key=lambda v: (v.last_used, v.version_id)) if idle else None


def refusal(manager: AdapterManager, event: ev.AdapterLoadRequested, old_version_id: int) -> tuple[int, str] | None:
    """(code, message) if the load must be refused: one pin past max_loras - 1, or one more
    on-demand adapter while every one registered on demand is in use. A load_inplace's
    replaced version does not count."""
    max_loras = manager.config.max_loras
    if event.pinned and len([v for v in manager.pinned_versions() if v != old_version_id]) >= max_loras - 1:
        return 400, (
            f"At most max_loras - 1 = {max_loras - 1} adapters may be pinned (--max-loras {max_loras}); "
            f"unload one, or reload it unpinned, first."
        )
    if event.on_demand and is_full(manager, old_version_id) and lru_idle(manager, old_version_id) is None:
        limit = manager.config.max_on_demand_loras
        return 503, (
            f"Cannot load adapter '{event.name}' on demand: all {limit} adapters loaded on demand "
            f"(--max-on-demand-loras) are in use by requests; retry later."
        )
    return None
