"""What one input changed in the adapter registry, as the HTTP process's mirror needs it: the
`AdapterRegistryChanged` the shell sends before that input's decisions. Derived from logged state
(the names the logged decisions register or unregister, read in the core's registry after them),
so not logged: the log grows by what each op changes, never by the size of the registry."""

from __future__ import annotations

from typing import Any

from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.shared import events as ev


def registry_changes(adapters: AdapterManager, decisions: list[Any]) -> ev.AdapterRegistryChanged | None:
    """Each name the decisions register or unregister (a load, a load_inplace, an unload, an LRU
    unregistration, a failed load), as it stands now: its current version, or gone. None: none."""
    touched = [d.name for d in decisions if isinstance(d, (ev.AdapterRegistered, ev.AdapterUnloaded))]
    if not touched:
        return None
    registered: list[ev.AdapterInfo] = []
    unregistered: list[str] = []
    for name in dict.fromkeys(touched):  # first appearance order
        version_id = adapters.registry.get(name)
        if version_id is None:
            unregistered.append(name)
            continue
        v = adapters.versions[version_id]
        registered.append(ev.AdapterInfo(v.name, v.version_id, v.path, v.pinned, v.on_demand))
    return ev.AdapterRegistryChanged(registered, unregistered)
