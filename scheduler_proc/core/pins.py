"""User-pinned adapters take a GPU slot as soon as one can be had, and keep it.

Run after every input once the engine is ready, before the prefetch pass. Each pinned
version without a slot, by version id, takes the lowest FREE slot, else the least recently
used LOADED slot (tie-break: lowest index) whose version is not pinned and held by no live
request (so no waiting request loses the slot it is about to use); never a slot a step in
flight reads. Overlapped loading: the slot LOADS and becomes ready as any other load
(prefetch.load_into); reference path: it is assigned at once (the workers load in command
order). The pass stops at the first pinned version that finds no slot; it gets one on a
later input, when a running request's slot is released.

Keeping the slot is the other passes' part: the reference path's LRU choice and the
prefetch pass never take a pinned version's slot, and the CPU tier never drops a version
that is in a slot.
"""

from __future__ import annotations

from collections.abc import Iterable

from ledgerserve.scheduler_proc.core import prefetch
from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.slots import Slot, SlotState


def place(adapters: AdapterManager, waiting: Iterable[Request], step: int, busy_slots: list[int]) -> Decisions:
    """Slots for the pinned versions that hold none."""
    unplaced = [v for v in adapters.pinned_versions() if adapters.slots.find(v) < 0]
    if not unplaced:
        return []
    config = adapters.config
    order = prefetch.lookahead(waiting, config.max_num_seqs, prefetch.LOOKAHEAD_VERSIONS_PER_SLOT * config.max_loras)
    decisions: Decisions = []
    for version_id in unplaced:
        slot = pin_victim(adapters, busy_slots)
        if slot is None:
            break
        if config.lora_overlap_loading:
            decisions += prefetch.load_into(adapters, slot, version_id, order, step)
        else:
            decisions += adapters.take_slot(slot, version_id, step)
    return decisions


def pin_victim(adapters: AdapterManager, busy_slots: list[int]) -> Slot | None:
    slots = [s for s in adapters.slots.slots if s.index not in busy_slots]
    for slot in slots:
        if slot.state == SlotState.FREE:
            return slot
    pinned = adapters.pinned_versions()
    candidates = [
        s
        for s in slots
        if s.state == SlotState.LOADED and s.version_id not in pinned and adapters.versions[s.version_id].num_reqs == 0
    ]
    return min(candidates, key=lambda s: (s.last_used_step, s.index)) if candidates else None
