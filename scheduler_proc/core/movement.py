"""The core's adapter inputs: a user's load and unload, and what the workers' load reports
do to the slots (overlapped adapter loading).

A slot assigned by the prefetch pass is LOADING until every rank (tensor_parallel_size)
reported AdapterLoadCompleted for that slot and version; it is then READY (LOADED) and
admission may use it. A report for a slot that no longer loads that version, or a rank's
second report, is stale: logged (it is an input) and ignored. Slot -1 reports a CPU-tier
staging: it is noted per rank for the views, and nothing waits on it.

A version unregistered while its slot loads (unload, load_inplace) and held by no request
is dropped when the load ends: evicted once every rank is done, freed at once if a rank
fails. It is never evicted mid-load. A failed load frees its slot at once: AdapterEvicted
tells every rank to clear it, and a rank whose load still runs clears it when that ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerserve.scheduler_proc.core import finish, prefix
from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.slots import SlotState
from ledgerserve.shared import events as ev

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.core import Core


def on_adapter_load_requested(core: Core, event: ev.AdapterLoadRequested) -> Decisions:
    return _evict_unregistered(core, core.adapters.load(event, core.step))


def on_adapter_unload_requested(core: Core, event: ev.AdapterUnloadRequested) -> Decisions:
    return _evict_unregistered(core, core.adapters.unload(event))


def on_adapter_load_completed(core: Core, event: ev.AdapterLoadCompleted) -> Decisions:
    """Overlapped loading: a slot is ready once every rank reported it. Reference path:
    logged only (a step's plan already waits on the worker side)."""
    return load_completed(core.adapters, event)


def on_adapter_load_failed(core: Core, event: ev.AdapterLoadFailed) -> Decisions:
    """Free its slot if it was loading, fail every request of the version, unregister it."""
    version = core.adapters.versions.get(event.version_id)
    if version is None:
        return []  # already dropped (another rank reported it first)
    message = (
        f"adapter {version.name!r} (version {version.version_id}) failed to load on rank {event.rank}: {event.message}"
    )
    decisions: Decisions = abort_load(core.adapters, event.version_id)
    for req in sorted(core.live_requests(), key=lambda r: r.arrival_order):
        if req.version_id == event.version_id:
            decisions += finish.fail_request(core, req, message)
    return decisions + _evict_unregistered(core, core.adapters.fail(event.version_id))


def _evict_unregistered(core: Core, decisions: Decisions) -> Decisions:
    """An unregistered adapter version's namespace leaves the prefix cache."""
    if not core.scheduler.is_ready:
        return decisions
    evicted = prefix.evict_namespaces(core.scheduler.block_manager, prefix.unregistered_versions(decisions))
    return prefix.before_reply(decisions, evicted)


def load_completed(adapters: AdapterManager, event: ev.AdapterLoadCompleted) -> Decisions:
    config = adapters.config
    if not config.lora_overlap_loading or not 0 <= event.rank < config.tensor_parallel_size:
        return []
    if event.slot == -1:
        _note_staged(adapters, event.version_id, event.rank)
        return []
    if not 0 <= event.slot < len(adapters.slots.slots):
        return []
    slot = adapters.slots.slots[event.slot]
    if slot.state != SlotState.LOADING or slot.version_id != event.version_id:
        return []
    _note_staged(adapters, event.version_id, event.rank)
    adapters.slots.report_done(slot.index, event.rank)
    if len(slot.ready_ranks) < config.tensor_parallel_size:
        return []
    adapters.slots.ready(slot.index)
    version = adapters.versions[event.version_id]
    if not version.is_registered and version.num_reqs == 0:
        return adapters.drop(event.version_id)  # unloaded (or replaced) while it loaded
    return []


def abort_load(adapters: AdapterManager, version_id: int) -> Decisions:
    """A rank could not load `version_id`: a LOADING slot goes FREE at once, and a version
    unregistered while it loaded, that nobody holds, is dropped. Its requests and its
    registration are the caller's (they fail as with overlapped loading off)."""
    index = adapters.slots.find(version_id)
    if not adapters.slots.is_loading(index):
        return []
    adapters.slots.fail(index)
    decisions: Decisions = [ev.AdapterEvicted(index, version_id)]
    version = adapters.versions[version_id]
    if not version.is_registered and version.num_reqs == 0:
        decisions += adapters.drop(version_id)
    return decisions


def _note_staged(adapters: AdapterManager, version_id: int, rank: int) -> None:
    """A rank holds the version in its CPU tier (a slot load stages it too)."""
    ranks = adapters.cpu_staged_ranks.get(version_id, [])
    if version_id in adapters.cpu_last_used_step and rank not in ranks:
        adapters.cpu_staged_ranks[version_id] = sorted(ranks + [rank])
