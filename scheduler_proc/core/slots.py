"""Adapter GPU slots: a fixed table, one lifecycle transition function, LRU victims.

A slot is FREE, LOADING (assigned a version whose load not every rank has reported done),
LOADED (holds a version, no running request uses it) or PINNED (running requests use it):

    FREE -ASSIGN-> LOADING -READY-> LOADED -PIN-> PINNED -UNPIN-> PINNED | LOADED
    LOADED -EVICT-> FREE        LOADING -FAIL-> FREE

Pins count the running requests; only a LOADED slot can be evicted; a LOADING slot is never
pinned (no step reads it) and never evicted. With overlapped loading off, READY follows
ASSIGN at once (the workers load in command order, before the step that needs the slot).
A LOADED or PINNED slot may drain for a waiting version (drain.py); once the slot is loaded
with that version it stays reserved for it until a request of it runs there. The mark goes
when the slot is freed or the drain is cancelled.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SlotState(enum.Enum):
    FREE = "free"
    LOADING = "loading"
    LOADED = "loaded"
    PINNED = "pinned"


class SlotAction(enum.Enum):
    ASSIGN = "assign"  # load a version into a free slot
    READY = "ready"  # every rank reported the load done
    FAIL = "fail"  # a rank could not load it: the slot is free again
    PIN = "pin"  # a request starts running on it
    UNPIN = "unpin"  # a running request leaves it (finish, abort, preemption)
    EVICT = "evict"  # free it


_LEGAL_EDGES: dict[tuple[SlotState, SlotAction], SlotState] = {
    (SlotState.FREE, SlotAction.ASSIGN): SlotState.LOADING,
    (SlotState.LOADING, SlotAction.READY): SlotState.LOADED,
    (SlotState.LOADING, SlotAction.FAIL): SlotState.FREE,
    (SlotState.LOADED, SlotAction.PIN): SlotState.PINNED,
    (SlotState.PINNED, SlotAction.PIN): SlotState.PINNED,
    (SlotState.PINNED, SlotAction.UNPIN): SlotState.PINNED,  # LOADED once the last pin goes
    (SlotState.LOADED, SlotAction.EVICT): SlotState.FREE,
}


class IllegalSlotTransition(RuntimeError):
    pass


@dataclass
class Slot:
    index: int
    state: SlotState = SlotState.FREE
    version_id: int = 0  # 0 while FREE
    num_pins: int = 0  # running requests using the slot
    last_used_step: int = 0
    ready_ranks: list[int] = field(default_factory=list)  # while LOADING: ranks whose load is done, ascending
    drain_for_version_id: int = 0  # draining for this waiting version, or reserved for it once it holds it; 0: neither


def transition_slot(slot: Slot, action: SlotAction) -> None:
    """The only place a slot's state and pin count change; raises on an illegal edge."""
    new_state = _LEGAL_EDGES.get((slot.state, action))
    if new_state is None:
        raise IllegalSlotTransition(f"slot {slot.index}: illegal {action.name} on a {slot.state.name} slot")
    if action in (SlotAction.READY, SlotAction.FAIL):
        slot.ready_ranks = []
    if action == SlotAction.PIN:
        slot.num_pins += 1
    elif action == SlotAction.UNPIN:
        slot.num_pins -= 1
        new_state = SlotState.PINNED if slot.num_pins else SlotState.LOADED
    slot.state = new_state


def lru_victim(slots: list[Slot], needed_version_ids: list[int]) -> Slot | None:
    """The slot to load into: the lowest FREE one, else the LOADED one least recently used
    (tie-break: lowest index) whose version this step does not need. None if there is none."""
    for slot in slots:
        if slot.state == SlotState.FREE:
            return slot
    candidates = [s for s in slots if s.state == SlotState.LOADED and s.version_id not in needed_version_ids]
    if not candidates:
        return None
    return min(candidates, key=lambda s: (s.last_used_step, s.index))


class SlotTable:
    def __init__(self, num_slots: int) -> None:
        self.slots = [Slot(i) for i in range(num_slots)]

    def find(self, version_id: int) -> int:
        """The slot holding `version_id`, or -1."""
        for slot in self.slots:
            if slot.state != SlotState.FREE and slot.version_id == version_id:
                return slot.index
        return -1

    @property
    def num_pinned(self) -> int:
        return sum(1 for slot in self.slots if slot.state == SlotState.PINNED)

    @property
    def num_used(self) -> int:
        return sum(1 for slot in self.slots if slot.state != SlotState.FREE)

    @property
    def num_loading(self) -> int:
        return sum(1 for slot in self.slots if slot.state == SlotState.LOADING)

    def is_ready(self, version_id: int) -> bool:
        """Whether `version_id` is in a slot every rank has loaded (LOADED or PINNED)."""
        index = self.find(version_id)
        return index >= 0 and self.slots[index].state in (SlotState.LOADED, SlotState.PINNED)

    def is_loading(self, index: int) -> bool:
        return index >= 0 and self.slots[index].state == SlotState.LOADING

    def assign(self, index: int, version_id: int, step: int) -> None:
        """FREE -> LOADED, the reference path: the workers load in command order, before the
        step that needs the slot, so the load is as good as done (ASSIGN, then READY)."""
        self.start_load(index, version_id, step)
        self.ready(index)

    def start_load(self, index: int, version_id: int, step: int) -> None:
        """FREE -> LOADING: the workers load `version_id` into the slot beside the steps."""
        slot = self.slots[index]
        transition_slot(slot, SlotAction.ASSIGN)
        slot.version_id = version_id
        slot.last_used_step = step

    def report_done(self, index: int, rank: int) -> None:
        """One more rank finished the LOADING slot's load (a rank counts once)."""
        slot = self.slots[index]
        if slot.state != SlotState.LOADING:
            raise IllegalSlotTransition(f"slot {index}: a load reported done on a {slot.state.name} slot")
        if rank not in slot.ready_ranks:
            slot.ready_ranks = sorted(slot.ready_ranks + [rank])

    def ready(self, index: int) -> None:
        transition_slot(self.slots[index], SlotAction.READY)

    def evict(self, index: int) -> int:
        """Free a LOADED slot; returns the version it held."""
        transition_slot(self.slots[index], SlotAction.EVICT)
        return self._clear(index)

    def fail(self, index: int) -> int:
        """Free a LOADING slot whose load failed; returns the version it was loading."""
        transition_slot(self.slots[index], SlotAction.FAIL)
        return self._clear(index)

    def _clear(self, index: int) -> int:
        slot = self.slots[index]
        version_id, slot.version_id, slot.last_used_step = slot.version_id, 0, 0
        slot.drain_for_version_id = 0  # a freed slot's drain is done
        return version_id

    def start_drain(self, index: int, for_version_id: int) -> None:
        slot = self.slots[index]
        if (
            slot.state not in (SlotState.LOADED, SlotState.PINNED)
            or slot.drain_for_version_id
            or for_version_id in (0, slot.version_id)
        ):
            raise IllegalSlotTransition(
                f"slot {index}: cannot drain a {slot.state.name} slot for version {for_version_id}"
            )
        slot.drain_for_version_id = for_version_id

    def reserve(self, index: int) -> None:
        """A drained slot now loads the version it drained for: it stays that version's until it runs there."""
        slot = self.slots[index]
        if slot.state != SlotState.LOADING:
            raise IllegalSlotTransition(f"slot {index}: cannot reserve a {slot.state.name} slot")
        slot.drain_for_version_id = slot.version_id

    def end_drain(self, index: int) -> None:
        self.slots[index].drain_for_version_id = 0

    def is_draining(self, index: int) -> bool:
        """Draining for another version (not reserved for the one it holds)."""
        slot = self.slots[index]
        return slot.drain_for_version_id not in (0, slot.version_id)

    def pin(self, index: int) -> None:
        transition_slot(self.slots[index], SlotAction.PIN)
        if self.slots[index].drain_for_version_id == self.slots[index].version_id:
            self.slots[index].drain_for_version_id = 0  # a reservation ends when its version runs there

    def unpin(self, index: int) -> None:
        transition_slot(self.slots[index], SlotAction.UNPIN)

    def touch(self, index: int, step: int) -> None:
        self.slots[index].last_used_step = step

    def rows(self) -> list[list[object]]:
        return [[s.index, s.state.value, s.version_id, s.num_pins, s.last_used_step] for s in self.slots]

    def drain_rows(self) -> list[list[int]]:
        return [[s.index, s.version_id, s.drain_for_version_id] for s in self.slots if s.drain_for_version_id]
