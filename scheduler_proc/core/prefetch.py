"""Prefetch with overlapped adapter loading (S-LoRA's policy): load the adapters the head of
the waiting queue needs into GPU slots and the CPU tier before admission wants them. Run
after every input once the engine is ready, before planning; every move is a decision.

Lookahead: the waiting queue in the order admission considers it (FCFS), its first
`max_num_seqs` requests (no more can join one step), and of those the first
`4 * max_loras` distinct adapter versions (enough to fill every slot and stage what comes
next, without walking a long queue on every input).

Slots, for each version of the lookahead without one, in lookahead order: the lowest FREE
slot, else a LOADED slot (unpinned, not loading) whose version no running request and no
earlier-in-the-lookahead request needs: first one whose version no waiting request needs at
all, then the least recently used (logical step), then the lowest index. Never a slot,
FREE or LOADED, that a step still in flight reads, so a load never overwrites what a
running step uses. Decisions: AdapterEvicted (if it held one), AdapterSlotAssigned; the
slot is LOADING until every rank reports it done. The pass stops at the first version that
cannot have a slot: a version never takes a slot from one ahead of it.

CPU tier, for the versions after that point which are in no slot and not staged:
AdapterPrefetched while the tier has room or holds a version in no slot that no request of
the lookahead needs (the least recently used goes: AdapterCpuEvicted); it stops at the
first version that cannot be staged. A slot load stages its version too: if the tier is
full, one in no slot goes first, the least recently used not in the lookahead, else the
one the lookahead needs last (a slot for an earlier version beats staging a later one).
"""

from __future__ import annotations

from collections.abc import Iterable

from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.slots import Slot, SlotState

LOOKAHEAD_VERSIONS_PER_SLOT = 4


def prefetch(
    adapters: AdapterManager, order: list[int], step: int, busy_slots: list[int], drained: dict[int, int] | None = None
) -> Decisions:
    """The prefetch pass over `order` (the lookahead, in the order its versions get slots):
    slots for its head, then the CPU tier for the rest. `drained`: version -> the idle slot a
    drain freed for it (drain.py), which it takes first and no other version takes."""
    decisions: Decisions = []
    waiting_needs = _waiting_needs(adapters)  # the pass moves adapters, never requests
    drained = drained or {}
    num_slotted = 0  # versions of the order, from its head, that are in a slot
    is_blocked = False  # a version found no slot: later ones take only slots drained for them
    for version_id in order:
        if adapters.slots.find(version_id) >= 0:
            num_slotted += int(not is_blocked)
            continue
        slot = adapters.slots.slots[drained[version_id]] if version_id in drained else None
        if slot is None and not is_blocked:
            protected = order[:num_slotted] + adapters.pinned_versions()  # a user-pinned slot is never taken
            slot = slot_victim(adapters.slots.slots, protected, waiting_needs, busy_slots)
        if slot is None:
            is_blocked = True
            continue
        decisions += load_into(adapters, slot, version_id, order, step)
        if version_id in drained:
            adapters.slots.reserve(slot.index)
        num_slotted += int(not is_blocked)
    return decisions + _stage_rest(adapters, order, order[num_slotted:], step)


def lookahead(waiting: Iterable[Request], max_num_reqs: int, max_num_versions: int) -> list[int]:
    """The distinct adapter versions of the first `max_num_reqs` waiting requests, in queue
    order, at most `max_num_versions` of them."""
    versions: list[int] = []
    for i, req in enumerate(waiting):
        if i >= max_num_reqs or len(versions) >= max_num_versions:
            break
        if req.version_id and req.version_id not in versions:
            versions.append(req.version_id)
    return versions


def slot_victim(
    slots: list[Slot], protected: list[int], waiting_needs: dict[int, bool], busy_slots: list[int]
) -> Slot | None:
    """The slot to load into, never one in `busy_slots` (read by a step in flight) or draining
    for a version: the lowest FREE one, else the LOADED one whose version is not `protected`
    and no waiting request needs, then LRU, then the lowest index. None if there is none."""
    for slot in slots:
        if slot.state == SlotState.FREE and slot.index not in busy_slots:
            return slot
    candidates = [
        s
        for s in slots
        if s.state == SlotState.LOADED
        and s.version_id not in protected
        and s.index not in busy_slots
        and not s.drain_for_version_id
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (waiting_needs.get(s.version_id, False), s.last_used_step, s.index))


def cpu_victim(tier: dict[int, int], in_slots: list[int], order: list[int], must: bool) -> int | None:
    """The CPU-tier version to drop: never one in a slot; the LRU (tie-break: lowest id) one
    the lookahead does not need; if `must`, else the one the lookahead needs last."""
    free = [v for v in sorted(tier) if v not in in_slots]
    unneeded = [v for v in free if v not in order]
    if unneeded:
        return min(unneeded, key=lambda v: (tier[v], v))
    if must and free:
        return max(free, key=lambda v: order.index(v))
    return None


def load_into(adapters: AdapterManager, slot: Slot, version_id: int, order: list[int], step: int) -> Decisions:
    """Evict the slot's version, make room for `version_id` in the CPU tier, start the load."""
    decisions: Decisions = []
    if slot.state == SlotState.LOADED:
        decisions.append(adapters.evict_slot(slot))
    if (
        version_id not in adapters.cpu_last_used_step
        and len(adapters.cpu_last_used_step) >= adapters.config.max_cpu_loras
    ):
        victim = cpu_victim(adapters.cpu_last_used_step, _slotted(adapters), order, must=True)
        if victim is None:
            raise RuntimeError(f"no CPU-tier entry for adapter version {version_id}: every one is in a slot")
        decisions.append(adapters.evict_cpu(victim))
    return decisions + [adapters.start_slot_load(slot, version_id, step)]


def _stage_rest(adapters: AdapterManager, order: list[int], rest: list[int], step: int) -> Decisions:
    decisions: Decisions = []
    tier = adapters.cpu_last_used_step
    for version_id in rest:
        if version_id in tier or adapters.slots.find(version_id) >= 0:
            continue
        if len(tier) >= adapters.config.max_cpu_loras:
            victim = cpu_victim(tier, _slotted(adapters), order, must=False)
            if victim is None:
                break
            decisions.append(adapters.evict_cpu(victim))
        decisions.append(adapters.stage(version_id, step))
    return decisions


def _waiting_needs(adapters: AdapterManager) -> dict[int, bool]:
    """Version -> whether a live request holds it (a LOADED slot's holders all wait)."""
    return {v: adapters.versions[v].num_reqs > 0 for v in sorted(adapters.versions)}


def _slotted(adapters: AdapterManager) -> list[int]:
    return [s.version_id for s in adapters.slots.slots if s.state != SlotState.FREE]
