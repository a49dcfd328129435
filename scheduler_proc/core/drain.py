"""Targeted drains (overlapped loading with `Policy.targeted_drain`): when a waiting
request's adapter version has no slot and none can be had, one slot is drained for it instead
of barring every adapter request behind it. Every start and cancellation is a logged decision.

Slot order (which waiting version a slot serves first): the lookahead's versions (the first
`max_num_seqs` waiting requests, at most 4 x `max_loras` versions). Those whose oldest waiting
request has waited `lora_max_wait_steps` (W) come first, FCFS; then the rest, the most waiting
requests first (more requests served per slot switch), ties FCFS. The prefetch pass gives free
and idle slots in this order. Aged versions go FCFS so the bound below holds; under sustained
oversubscription most contested versions are aged, so in scripts/adapters/simulate_adapter_policy.py
this order and plain FCFS come out within a few percent of each other.

Start: walking the slot order, a version with no slot, no drain for it and no spare slot (FREE,
or LOADED and idle for no version of the lookahead: a step in flight still reads it) gets a
drain once its oldest waiting request R has waited W steps (until then requests of resident
adapters may pass it, and a slot may come free by itself). The victim is a PINNED slot, not
draining, whose version no earlier version of the order and no waiting request ahead of R
needs, and none a user pinned: the one whose running requests have
the least remaining work (the most, over them, of the tokens they may still generate), then
the fewest waiting requests for its version, then least recently used, then the lowest index.
AdapterDrainStarted(slot, version, for version, remaining tokens).

While a slot drains, waiting requests of its version behind R are not admitted (those ahead of
R, put there by a preemption, still are); every other request is. Once the slot is idle and no
step in flight reads it, the prefetch pass loads the drain's version there (AdapterEvicted then
ends the drain) unless a waiting request ahead of R still needs what it holds; no other
version takes it. AdapterDrainCancelled when the version got another slot, no request waits
for it, or it left the lookahead; the slot's version is admitted again.

Bound: with R's version first in the slot order from step t0 + W on (it is aged; only older
aged versions precede it) and no preemption, its drain starts at step t0 + W if some slot may
drain; the victim's running requests end within their remaining tokens D (logged with the
drain; each decodes one token a step, plus the steps their prompts still take), the slot is
read by at most the step in flight, its load takes L steps, and R is admitted in the next
step: R runs by step t0 + W + D + L + 2 (plus waiting for max_num_seqs or KV blocks).
"""

from __future__ import annotations

from collections.abc import Iterable

from ledgerserve.scheduler_proc.core import prefetch
from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.prefetch import LOOKAHEAD_VERSIONS_PER_SLOT
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.slots import Slot, SlotState
from ledgerserve.shared import events as ev


def movement_pass(
    adapters: AdapterManager, waiting: Iterable[Request], running: list[Request], step: int, busy_slots: list[int]
) -> Decisions:
    """Cancel the drains no longer needed, prefetch in slot order (a drained slot goes to its
    version), cancel those whose version just got another slot, start the drains now needed."""
    view = WaitingView(waiting, adapters.config)
    decisions = cancel_unneeded(adapters, view)
    order = slot_order(adapters, view, step)
    decisions += prefetch.prefetch(adapters, order, step, busy_slots, drained_slots(adapters, view, busy_slots))
    decisions += cancel_unneeded(adapters, view)
    return decisions + start_needed(adapters, view, order, running, step)


class WaitingView:
    """The lookahead as the drain pass reads it: its versions FCFS, and for each its oldest
    waiting request's queue position and arrival step (lookups only)."""

    def __init__(self, waiting: Iterable[Request], config: CoreConfig) -> None:
        self.fcfs: list[int] = []
        self.first_index: dict[int, int] = {}
        self.first_arrival_step: dict[int, int] = {}
        max_num_versions = LOOKAHEAD_VERSIONS_PER_SLOT * config.max_loras
        for i, req in enumerate(waiting):
            if i >= config.max_num_seqs or len(self.fcfs) >= max_num_versions:
                break
            if req.version_id and req.version_id not in self.first_index:
                self.fcfs.append(req.version_id)
                self.first_index[req.version_id] = i
                self.first_arrival_step[req.version_id] = req.arrival_step

    def ahead_of(self, version_id: int) -> list[int]:
        """Versions with a waiting request ahead of `version_id`'s oldest one."""
        return self.fcfs[: self.fcfs.index(version_id)]


def num_waiting(adapters: AdapterManager, version_id: int) -> int:
    """Waiting requests of a version: those holding it less those running on its slot."""
    index = adapters.slots.find(version_id)
    return adapters.versions[version_id].num_reqs - (adapters.slots.slots[index].num_pins if index >= 0 else 0)


def slot_order(adapters: AdapterManager, view: WaitingView, step: int) -> list[int]:
    """The lookahead in the order its versions get slots: aged ones FCFS, then the most
    waiting requests first, ties FCFS."""
    aged = [v for v in view.fcfs if _is_aged(view, v, step, adapters.config)]
    rest = [v for v in view.fcfs if v not in aged]
    return aged + sorted(rest, key=lambda v: (-num_waiting(adapters, v), view.first_index[v]))


def draining(adapters: AdapterManager) -> dict[int, int]:
    """For admission: a draining slot's version -> the version it drains for."""
    slots = adapters.slots
    return {s.version_id: s.drain_for_version_id for s in slots.slots if slots.is_draining(s.index)}


def drained_slots(adapters: AdapterManager, view: WaitingView, busy_slots: list[int]) -> dict[int, int]:
    """For the prefetch pass: version -> the slot drained for it, once idle, read by no step in
    flight, and holding a version no waiting request ahead of the drain's request needs."""
    out: dict[int, int] = {}
    for slot in adapters.slots.slots:
        target = slot.drain_for_version_id
        if (
            adapters.slots.is_draining(slot.index)
            and target in view.first_index
            and slot.state == SlotState.LOADED
            and slot.index not in busy_slots
            and slot.version_id not in view.ahead_of(target)
        ):
            out[target] = slot.index
    return out


def remaining_tokens(req: Request, max_model_len: int) -> int:
    """At most how many more tokens `req` generates (max_tokens, or the model length)."""
    return max(0, min(req.sampling.max_tokens - req.num_output_tokens, max_model_len - req.num_tokens))


def cancel_unneeded(adapters: AdapterManager, view: WaitingView) -> Decisions:
    """End the drains whose version got another slot, has no waiting request, or left the lookahead."""
    decisions: Decisions = []
    for slot in adapters.slots.slots:
        for_version_id = slot.drain_for_version_id
        reason = _cancel_reason(adapters, view, slot, for_version_id) if for_version_id else ""
        if reason:
            adapters.slots.end_drain(slot.index)
            decisions.append(ev.AdapterDrainCancelled(slot.index, slot.version_id, for_version_id, reason))
    return decisions


def _cancel_reason(adapters: AdapterManager, view: WaitingView, slot: Slot, for_version_id: int) -> str:
    if adapters.slots.find(for_version_id) not in (-1, slot.index):
        return "it has another slot"
    if for_version_id not in adapters.versions or not num_waiting(adapters, for_version_id):
        return "no request waits for it"
    if for_version_id not in view.first_index:
        return "it left the lookahead"
    return ""


def start_needed(
    adapters: AdapterManager, view: WaitingView, order: list[int], running: list[Request], step: int
) -> Decisions:
    """Start a drain for each version of the order that needs one (after the prefetch pass)."""
    slots = adapters.slots
    pinned = adapters.pinned_versions()  # user pins: their slots never come free nor drain
    num_spare = sum(1 for s in slots.slots if _is_spare(s, view) and s.version_id not in pinned)
    targets = [s.drain_for_version_id for s in slots.slots if s.drain_for_version_id]
    decisions: Decisions = []
    for i, version_id in enumerate(order):
        if slots.find(version_id) >= 0 or version_id in targets:
            continue
        if num_spare:
            num_spare -= 1  # a slot comes free without a drain
            continue
        if not _is_aged(view, version_id, step, adapters.config):
            continue  # affinity: requests of resident adapters may pass it until then
        protected = order[:i] + view.ahead_of(version_id) + pinned
        victim = _victim(adapters, running, protected)
        if victim is None:
            continue  # every slot is draining, loading or needed ahead
        slot, num_remaining = victim
        slots.start_drain(slot.index, version_id)
        decisions.append(ev.AdapterDrainStarted(slot.index, slot.version_id, version_id, num_remaining))
    return decisions


def _is_aged(view: WaitingView, version_id: int, step: int, config: CoreConfig) -> bool:
    """Whether the version's oldest waiting request has waited the max wait by the step planned
    next (`step` + 1), as admission counts it."""
    return step + 1 - view.first_arrival_step[version_id] >= config.lora_max_wait_steps


def _is_spare(slot: Slot, view: WaitingView) -> bool:
    if slot.state == SlotState.FREE:
        return True
    return slot.state == SlotState.LOADED and not slot.drain_for_version_id and slot.version_id not in view.first_index


def _victim(adapters: AdapterManager, running: list[Request], protected: list[int]) -> tuple[Slot, int] | None:
    """The slot that frees soonest among those that may drain, with its remaining work."""
    max_model_len = adapters.config.max_model_len
    best: tuple[tuple[int, int, int, int], Slot] | None = None
    for slot in adapters.slots.slots:
        if not _may_drain(slot, protected):
            continue
        work = max((remaining_tokens(r, max_model_len) for r in running if r.lora_slot == slot.index), default=0)
        key = (work, num_waiting(adapters, slot.version_id), slot.last_used_step, slot.index)
        if best is None or key < best[0]:
            best = (key, slot)
    return None if best is None else (best[1], best[0][0])


def _may_drain(slot: Slot, protected: list[int]) -> bool:
    """Running requests use it, it drains for no one, and no request ahead needs its version."""
    return slot.state == SlotState.PINNED and not slot.drain_for_version_id and slot.version_id not in protected
