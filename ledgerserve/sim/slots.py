"""The fake worker group's adapter side: every rank's slot table and CPU tier in stream
order, and the loads each rank has not finished yet.

Reference path (overlapped loading off): a rank loads a slot in command order, before the
next plan, so an AdapterSlotAssigned is as good as done on every rank. Overlapped loading:
each AdapterSlotAssigned / AdapterPrefetched starts one load per rank, which ends only when
the caller (or a seeded LoadPolicy) delivers its AdapterLoadCompleted or AdapterLoadFailed,
in any order. A slot evicted while a rank still loads it is cleared once that load ends;
that load's completion still arrives, late, and the core must ignore it.

Checks, in stream order: a plan's requests point at slots holding their own version that
every rank has finished loading; AdapterSlotAssigned only takes a free slot no running
request uses; a version is in at most one slot; AdapterEvicted names what the slot holds
and no running request uses it. With overlapped loading, also: the CPU tier (a version
from its AdapterPrefetched or AdapterSlotAssigned on) never exceeds max_cpu_loras, is never
staged twice, and never drops a version in a slot.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from ledgerserve.shared import events as ev


@dataclass(frozen=True)
class PendingLoad:
    rank: int
    slot: int  # -1: a CPU staging
    version_id: int
    load_id: int  # which assignment of the slot (or staging) it belongs to


class FakeSlots:
    def __init__(self, num_ranks: int, max_cpu_loras: int, overlap: bool) -> None:
        self.num_ranks = num_ranks
        self.max_cpu_loras = max_cpu_loras
        self.overlap = overlap
        self.versions: dict[int, int] = {}  # slot -> version id
        self.ready_ranks: dict[int, list[int]] = {}  # slot -> ranks that finished its load
        self.load_ids: dict[int, int] = {}  # slot -> the current assignment's load id
        self.req_slot: dict[str, int] = {}  # running adapter request -> its slot
        self.cpu: list[int] = []  # CPU-tier versions
        self.pending: list[PendingLoad] = []  # loads started, not finished; oldest first
        self._num_loads = 0

    def pinned(self, slot: int) -> bool:
        return slot in self.req_slot.values()

    def apply(self, decision: Any) -> None:
        if isinstance(decision, ev.AdapterSlotAssigned):
            self._assign(decision.slot, decision.version_id)
        elif isinstance(decision, ev.AdapterEvicted):
            if self.pinned(decision.slot) or self.versions.get(decision.slot) != decision.version_id:
                raise AssertionError(
                    f"bad eviction of slot {decision.slot}: holds {self.versions.get(decision.slot)}, "
                    f"pinned={self.pinned(decision.slot)}"
                )
            del self.versions[decision.slot], self.ready_ranks[decision.slot], self.load_ids[decision.slot]
        elif isinstance(decision, ev.AdapterPrefetched) and self.overlap:
            if decision.version_id in self.cpu:
                raise AssertionError(f"version {decision.version_id} staged while already in the CPU tier")
            self._enter_cpu(decision.version_id)
            self._start_loads(-1, decision.version_id)
        elif isinstance(decision, ev.AdapterCpuEvicted) and self.overlap:
            if decision.version_id not in self.cpu or decision.version_id in self.versions.values():
                raise AssertionError(
                    f"version {decision.version_id} left the CPU tier while in a slot, or was not in it"
                )
            self.cpu.remove(decision.version_id)

    def _assign(self, slot: int, version_id: int) -> None:
        if self.pinned(slot) or slot in self.versions:
            raise AssertionError(f"slot {slot} assigned while pinned, loading or loaded ({self.versions.get(slot)})")
        if version_id in self.versions.values():
            raise AssertionError(f"version {version_id} assigned to a second slot")
        self.versions[slot] = version_id
        if not self.overlap:
            self.ready_ranks[slot] = list(range(self.num_ranks))
            self.load_ids[slot] = 0
            return
        if version_id not in self.cpu:
            self._enter_cpu(version_id)
        self.ready_ranks[slot] = []
        self.load_ids[slot] = self._start_loads(slot, version_id)

    def _enter_cpu(self, version_id: int) -> None:
        self.cpu.append(version_id)
        if len(self.cpu) > self.max_cpu_loras:
            raise AssertionError(f"the CPU tier holds {len(self.cpu)} versions > max_cpu_loras {self.max_cpu_loras}")

    def _start_loads(self, slot: int, version_id: int) -> int:
        self._num_loads += 1
        self.pending += [PendingLoad(rank, slot, version_id, self._num_loads) for rank in range(self.num_ranks)]
        return self._num_loads

    def finish(self, load: PendingLoad, failure: str | None) -> ev.AdapterLoadCompleted | ev.AdapterLoadFailed:
        """The rank's load ends: the event it reports. A slot load still current counts as
        done on that rank (a failed one leaves the slot to the core's AdapterEvicted)."""
        self.pending.remove(load)
        if failure is not None:
            return ev.AdapterLoadFailed(load.rank, load.slot, load.version_id, failure)
        if load.slot >= 0 and self.load_ids.get(load.slot) == load.load_id:
            self.ready_ranks[load.slot].append(load.rank)
        return ev.AdapterLoadCompleted(load.rank, load.slot, load.version_id, "disk", 1.0, 1000)

    def check_req(self, req_id: str, lora_slot: int, version_id: int) -> None:
        if version_id == 0:
            if lora_slot != -1:
                raise AssertionError(f"base request {req_id!r} in slot {lora_slot}")
            return
        if self.versions.get(lora_slot) != version_id:
            raise AssertionError(
                f"{req_id!r} of version {version_id} points to slot {lora_slot} holding {self.versions.get(lora_slot)}"
            )
        if sorted(self.ready_ranks[lora_slot]) != list(range(self.num_ranks)):
            raise AssertionError(
                f"{req_id!r} planned on slot {lora_slot}, loaded only on ranks {self.ready_ranks[lora_slot]}"
            )
        if self.req_slot.get(req_id, lora_slot) != lora_slot:
            raise AssertionError(f"{req_id!r} moved from slot {self.req_slot[req_id]} to {lora_slot} while running")
        self.req_slot[req_id] = lora_slot

    def end(self, req_id: str) -> None:
        self.req_slot.pop(req_id, None)


class LoadPolicy:
    """Seeded choices of when loads end: after each step, each pending load ends with
    probability `p_finish`, in a random order; a slot load fails with probability `p_fail`."""

    def __init__(self, seed: int, p_finish: float = 0.4, p_fail: float = 0.0) -> None:
        self.rng = random.Random(seed)
        self.p_finish = p_finish
        self.p_fail = p_fail

    def pick(self, pending: list[PendingLoad]) -> list[PendingLoad]:
        chosen = [load for load in pending if self.rng.random() < self.p_finish]
        self.rng.shuffle(chosen)
        return chosen

    def failure(self, load: PendingLoad) -> str | None:
        if load.slot >= 0 and self.rng.random() < self.p_fail:
            return f"content digest mismatch on rank {load.rank}: the files changed since registration"
        return None
