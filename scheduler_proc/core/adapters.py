"""Adapter versions: the registry (name -> current version), the GPU slot table, the CPU
tier, and deferred evictions. Every method returns the decisions it took.

A version lives until it is unregistered (unload, a load_inplace under its name, a failed
load) and no live request holds it; while unregistered but held it is a deferred eviction.
Dicts here are lookups only; every walk goes through sorted ids or the slot list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared import events as ev

from scheduler_proc.core.config import CoreConfig
from scheduler_proc.core.request import Request, RequestStatus
from scheduler_proc.core.scheduler import distinct
from scheduler_proc.core.slots import SlotState, SlotTable, lru_victim

Decisions = list[Any]


@dataclass
class AdapterVersion:
    version_id: int
    name: str
    path: str
    max_rank: int
    num_bytes: int
    is_registered: bool = True
    num_reqs: int = 0  # live (waiting or running) requests holding this version


class AdapterManager:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.registry: dict[str, int] = {}  # name -> current version id
        self.versions: dict[int, AdapterVersion] = {}  # live versions by id
        self.slots = SlotTable(config.max_loras)
        self.cpu_last_used_step: dict[int, int] = {}  # the CPU tier: version id -> last use
        self._num_versions = 0  # version ids count from 1; 0 is the base model

    # ------------------------------------------------------------------ views

    @property
    def num_deferred_evictions(self) -> int:
        return sum(1 for v in self.versions.values() if not v.is_registered)

    @property
    def num_pinned_slots(self) -> int:
        return self.slots.num_pinned

    def resolve(self, name: str) -> int | None:
        return self.registry.get(name)

    def infos(self) -> list[ev.AdapterInfo]:
        return [ev.AdapterInfo(name, self.registry[name], self.versions[self.registry[name]].path) for name in sorted(self.registry)]

    # ------------------------------------------------------------------ load / unload

    def load(self, event: ev.AdapterLoadRequested) -> Decisions:
        if not self.config.enable_lora:
            return [self._reply(event.op_id, 400, "LoRA is disabled; start the server with --enable-lora to load adapters.")]
        old_version_id = self.registry.get(event.name, 0)
        if old_version_id and not event.load_inplace:
            return [self._reply(event.op_id, 400, f"The lora adapter '{event.name}' has already been loaded; pass load_inplace=true to replace it.")]
        self._num_versions += 1
        version_id = self._num_versions
        self.versions[version_id] = AdapterVersion(version_id, event.name, event.path, event.max_rank, event.num_bytes)
        self.registry[event.name] = version_id
        decisions: Decisions = [ev.AdapterRegistered(event.name, version_id, event.path, old_version_id)]
        if old_version_id:
            decisions += self._unregister(old_version_id)
        return decisions + [self._reply(event.op_id, 200, "", version_id)]

    def unload(self, event: ev.AdapterUnloadRequested) -> Decisions:
        if not self.config.enable_lora:
            return [self._reply(event.op_id, 400, "LoRA is disabled; start the server with --enable-lora to unload adapters.")]
        version_id = self.registry.pop(event.name, 0)
        if not version_id:
            return [self._reply(event.op_id, 404, f"The lora adapter '{event.name}' cannot be found.")]
        decisions: Decisions = [ev.AdapterUnloaded(event.name, version_id)]
        decisions += self._unregister(version_id)
        return decisions + [self._reply(event.op_id, 200, "", version_id)]

    def fail(self, version_id: int) -> Decisions:
        """Unregister a version a worker could not load (its requests already failed)."""
        version = self.versions.get(version_id)
        if version is None or not version.is_registered:
            return []  # already gone, or already unregistered and dropped with its last request
        del self.registry[version.name]
        return [ev.AdapterUnloaded(version.name, version_id)] + self._unregister(version_id)

    def _unregister(self, version_id: int) -> Decisions:
        version = self.versions[version_id]
        version.is_registered = False
        if version.num_reqs == 0:
            return self._drop(version_id)
        return [ev.AdapterEvictionDeferred(version_id, self.slots.find(version_id), version.num_reqs)]

    def _drop(self, version_id: int) -> Decisions:
        """Free the slot and the CPU copy of an unregistered version nobody holds."""
        decisions: Decisions = []
        index = self.slots.find(version_id)
        if index >= 0:
            self.slots.evict(index)
            decisions.append(ev.AdapterEvicted(index, version_id))
        if version_id in self.cpu_last_used_step:
            del self.cpu_last_used_step[version_id]
            decisions.append(ev.AdapterCpuEvicted(version_id))
        del self.versions[version_id]
        return decisions

    def _reply(self, op_id: str, code: int, message: str, version_id: int = 0) -> ev.AdapterOpReplied:
        return ev.AdapterOpReplied(op_id, code, message, version_id, self.infos())

    # ------------------------------------------------------------------ requests

    def hold(self, req: Request) -> None:
        if req.version_id:
            self.versions[req.version_id].num_reqs += 1

    def release(self, req: Request) -> Decisions:
        """A request ends: unpin its slot if it was running, drop its version if that was
        the last holder of an unregistered one (the deferred eviction)."""
        if req.lora_slot >= 0:
            self.slots.unpin(req.lora_slot)
            req.lora_slot = -1
        if not req.version_id:
            return []
        version = self.versions[req.version_id]
        version.num_reqs -= 1
        if version.num_reqs == 0 and not version.is_registered:
            return self._drop(req.version_id)
        return []

    # ------------------------------------------------------------------ building a step

    def bind_step(self, reqs: list[Request], preempted: list[Request], step: int) -> Decisions:
        """Give this step's requests their slots. Preempted requests unpin first; then every
        adapter the step needs is known before any slot is chosen, so no victim is needed."""
        for req in preempted:
            if req.lora_slot >= 0:
                self.slots.unpin(req.lora_slot)
                req.lora_slot = -1
        needed = distinct([req.version_id for req in reqs if req.version_id])
        decisions: Decisions = []
        for version_id in needed:
            decisions += self._ensure_slot(version_id, needed, step)
        for req in reqs:
            if req.version_id and req.lora_slot < 0:
                req.lora_slot = self.slots.find(req.version_id)
                self.slots.pin(req.lora_slot)
        return decisions + self._trim_cpu_tier()

    def _ensure_slot(self, version_id: int, needed: list[int], step: int) -> Decisions:
        decisions: Decisions = []
        index = self.slots.find(version_id)
        if index < 0:
            victim = lru_victim(self.slots.slots, needed)
            if victim is None:
                raise RuntimeError(f"no GPU slot for adapter version {version_id}: the step holds more than max_loras adapters")
            index = victim.index
            if victim.state == SlotState.LOADED:
                decisions.append(ev.AdapterEvicted(index, self.slots.evict(index)))
            self.slots.assign(index, version_id, step)
            decisions.append(ev.AdapterSlotAssigned(index, version_id, self.versions[version_id].path))
        self.slots.touch(index, step)
        self.cpu_last_used_step[version_id] = step
        return decisions

    def _trim_cpu_tier(self) -> Decisions:
        """Above max_cpu_loras, the LRU versions not in a GPU slot leave the CPU tier."""
        decisions: Decisions = []
        while len(self.cpu_last_used_step) > self.config.max_cpu_loras:
            candidates = [v for v in sorted(self.cpu_last_used_step) if self.slots.find(v) < 0]
            victim = min(candidates, key=lambda v: (self.cpu_last_used_step[v], v))
            del self.cpu_last_used_step[victim]
            decisions.append(ev.AdapterCpuEvicted(victim))
        return decisions

    # ------------------------------------------------------------------ checks and views

    def check_integrity(self, live_reqs: list[Request]) -> None:
        num_pins = [0] * len(self.slots.slots)
        num_reqs: dict[int, int] = {}
        for req in live_reqs:
            _check_req_slot(req, self.slots)
            if req.lora_slot >= 0:
                num_pins[req.lora_slot] += 1
            if req.version_id:
                num_reqs[req.version_id] = num_reqs.get(req.version_id, 0) + 1
        for slot in self.slots.slots:
            _check_slot(slot, num_pins[slot.index], self.versions.get(slot.version_id))
            if slot.state != SlotState.FREE and (self.slots.find(slot.version_id) != slot.index or slot.version_id not in self.cpu_last_used_step):
                raise RuntimeError(f"slot {slot.index}: version {slot.version_id} is in two slots or not in the CPU tier")
        for version_id in sorted(self.versions):
            version = self.versions[version_id]
            if version.num_reqs != num_reqs.get(version_id, 0):
                raise RuntimeError(f"adapter version {version_id} counts {version.num_reqs} requests, {num_reqs.get(version_id, 0)} hold it")
            if version.is_registered != (self.registry.get(version.name) == version_id):
                raise RuntimeError(f"adapter version {version_id} and the registry disagree")
        for name in sorted(self.registry):
            if self.registry[name] not in self.versions:
                raise RuntimeError(f"the registry maps {name!r} to a dropped version")
        if len(self.cpu_last_used_step) > self.config.max_cpu_loras:
            raise RuntimeError(f"the CPU tier holds {len(self.cpu_last_used_step)} versions > max_cpu_loras {self.config.max_cpu_loras}")

    def rows(self) -> list[Any]:
        return [
            [[name, self.registry[name]] for name in sorted(self.registry)],
            [[v.version_id, v.name, v.path, v.is_registered, v.num_reqs] for v in self._sorted_versions()],
            self.slots.rows(),
            [[v, self.cpu_last_used_step[v]] for v in sorted(self.cpu_last_used_step)],
        ]

    def snapshot(self) -> dict[str, Any]:
        return {
            "registry": {name: self.registry[name] for name in sorted(self.registry)},
            "versions": [
                {"version_id": v.version_id, "name": v.name, "path": v.path, "is_registered": v.is_registered, "num_reqs": v.num_reqs}
                for v in self._sorted_versions()
            ],
            "slots": [
                {"slot": s.index, "state": s.state.name, "version_id": s.version_id, "num_pins": s.num_pins, "last_used_step": s.last_used_step}
                for s in self.slots.slots
            ],
            "cpu_tier": [[v, self.cpu_last_used_step[v]] for v in sorted(self.cpu_last_used_step)],
            "deferred_evictions": [v.version_id for v in self._sorted_versions() if not v.is_registered],
        }

    def _sorted_versions(self) -> list[AdapterVersion]:
        return [self.versions[v] for v in sorted(self.versions)]


def _check_req_slot(req: Request, slots: SlotTable) -> None:
    running = req.status == RequestStatus.RUNNING
    if req.version_id and running and (req.lora_slot < 0 or slots.slots[req.lora_slot].version_id != req.version_id):
        raise RuntimeError(f"running request {req.req_id!r} of version {req.version_id} is in slot {req.lora_slot}")
    if req.lora_slot >= 0 and not (running and req.version_id):
        raise RuntimeError(f"request {req.req_id!r} ({req.status.name}, version {req.version_id}) holds slot {req.lora_slot}")


def _check_slot(slot: Any, num_pins: int, version: AdapterVersion | None) -> None:
    if slot.num_pins != num_pins or (slot.state == SlotState.PINNED) != (num_pins > 0):
        raise RuntimeError(f"slot {slot.index} ({slot.state.name}) has {slot.num_pins} pins, {num_pins} running requests use it")
    if slot.state == SlotState.FREE:
        if slot.version_id:
            raise RuntimeError(f"free slot {slot.index} names version {slot.version_id}")
        return
    if version is None:
        raise RuntimeError(f"slot {slot.index} holds dropped version {slot.version_id}")
    if not version.is_registered and version.num_reqs == 0:
        raise RuntimeError(f"slot {slot.index} holds unregistered version {slot.version_id} that no request holds")
