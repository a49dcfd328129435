"""Adapter versions: the registry (name -> current version), the GPU slot table, the CPU
tier, and deferred evictions. Every method returns the decisions it took.

A version lives until it is unregistered (unload, a load_inplace under its name, a failed
load) and no live request holds it; while unregistered but held it is a deferred eviction.
With overlapped loading, a version whose slot is still LOADING also stays until that load
ends (every rank done, or one failed): a slot is never evicted mid-load. The CPU tier
(`cpu_last_used_step`) holds a version from its AdapterPrefetched or AdapterSlotAssigned on,
never more than `max_cpu_loras`, and never drops a version that is in a slot.

A version may be pinned by the user (AdapterLoadRequested.pinned): it takes a GPU slot as
soon as one can be had (pins.py) and no LRU choice, prefetch or CPU-tier trim takes that
slot; unregistering it (unload, load_inplace) frees the pin. A version registered on demand
(a request named it) counts toward `max_on_demand_loras`; one more past that unregisters the
least recently used idle one, and no other is ever unregistered implicitly (marks.py).
Dicts here are lookups only; every walk goes through sorted ids or the slot list.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledgerserve.scheduler_proc.core import adapter_views, marks
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.scheduler import distinct
from ledgerserve.scheduler_proc.core.slots import Slot, SlotState, SlotTable, lru_victim
from ledgerserve.shared import events as ev


@dataclass
class AdapterVersion:
    version_id: int
    name: str
    path: str
    max_rank: int
    num_bytes: int
    is_registered: bool = True
    num_reqs: int = 0  # live (waiting or running) requests holding this version
    content_digest: int = 0  # older logs' xxh64 of its files, passed through into the decisions
    pinned: bool = False  # the user's pin: keeps a GPU slot while registered
    on_demand: bool = False  # registered by a request naming it: unregistered when idle and least recently used
    last_used: int = 0  # on demand: the use clock at its registration or the last request naming it
    lineage_id: int = 0  # the first version of its chain of in-place reloads: a fresh registration's own id
    content_sha256: str = ""  # what its files must hash to when read again ("": not checked)


class AdapterManager:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.registry: dict[str, int] = {}  # name -> current version id
        self.versions: dict[int, AdapterVersion] = {}  # live versions by id
        self.slots = SlotTable(config.max_loras)
        self.cpu_last_used_step: dict[int, int] = {}  # the CPU tier: version id -> last use
        self.cpu_staged_ranks: dict[int, list[int]] = {}  # CPU-tier version -> ranks that reported it staged
        self._num_versions = 0  # version ids count from 1; 0 is the base model
        self.num_uses = 0  # the on-demand use clock: registrations and arrivals naming an on-demand version

    # ------------------------------------------------------------------ views

    @property
    def cpu_tier_bytes(self) -> int:
        return sum(self.versions[v].num_bytes for v in sorted(self.cpu_last_used_step))

    def resolve(self, name: str) -> int | None:
        return self.registry.get(name)

    def infos(self) -> list[ev.AdapterInfo]:
        current = [self.versions[self.registry[name]] for name in sorted(self.registry)]
        return [ev.AdapterInfo(v.name, v.version_id, v.path, v.pinned, v.on_demand) for v in current]

    def pinned_versions(self) -> list[int]:
        """The user-pinned versions, by id (pinned implies registered)."""
        return [v for v in sorted(self.versions) if self.versions[v].pinned]

    def pinned_in_slots(self) -> list[int]:
        """Pinned versions that hold a slot: each keeps it, so a step's cap counts it."""
        return [v for v in self.pinned_versions() if self.slots.find(v) >= 0]

    def same_adapter(self, version_id: int, named_version_id: int) -> bool:
        """Whether a request that named version `named_version_id` of this version's name may run
        on `version_id`: the same version, or one that replaced it in place (load_inplace). The
        name's versions from the lineage's first one on are all in-place reloads of it (a fresh
        registration after an unload starts a new lineage), and ids only grow."""
        return self.versions[version_id].lineage_id <= named_version_id <= version_id

    def note_use(self, version_id: int) -> None:
        """A request names `version_id`: an on-demand version becomes the most recently used."""
        version = self.versions.get(version_id)
        if version is not None and version.on_demand:
            self.num_uses += 1
            version.last_used = self.num_uses

    def slot_readiness(self) -> dict[int, bool] | None:
        """For admission with overlapped loading: version -> True if its slot is ready on
        every rank, False while it loads; a version in no slot is absent. None: the reference
        path, where a step's slots are assigned as it is built."""
        if not self.config.lora_overlap_loading:
            return None
        return {s.version_id: s.state != SlotState.LOADING for s in self.slots.slots if s.state != SlotState.FREE}

    # ------------------------------------------------------------------ load / unload

    def load(self, event: ev.AdapterLoadRequested, step: int) -> Decisions:
        if not self.config.enable_lora:
            return [
                self._reply(event.op_id, 400, "LoRA is disabled; start the server with --enable-lora to load adapters.")
            ]
        old_version_id = self.registry.get(event.name, 0)
        if old_version_id and not event.load_inplace:
            return [
                self._reply(
                    event.op_id,
                    400,
                    f"The lora adapter '{event.name}' has already been loaded; pass load_inplace=true to replace it.",
                )
            ]
        refusal = marks.refusal(self, event, old_version_id)
        if refusal is not None:
            return [self._reply(event.op_id, *refusal)]
        decisions: Decisions = self._make_room(event, old_version_id)
        self._num_versions += 1
        version_id = self._num_versions
        self.versions[version_id] = AdapterVersion(
            version_id,
            event.name,
            event.path,
            event.max_rank,
            event.num_bytes,
            content_digest=event.content_digest,
            pinned=event.pinned,
            on_demand=event.on_demand,
            lineage_id=self.versions[old_version_id].lineage_id if old_version_id else version_id,
            content_sha256=event.content_sha256,
        )
        self.registry[event.name] = version_id
        self.note_use(version_id)
        decisions.append(
            ev.AdapterRegistered(
                event.name, version_id, event.path, old_version_id, event.content_digest, event.content_sha256
            )
        )
        if old_version_id:
            decisions += self._unregister(old_version_id)
        if self.config.lora_overlap_loading and len(self.cpu_last_used_step) < self.config.max_cpu_loras:
            decisions.append(self.stage(version_id, step))  # into a free CPU entry only: never evicts here
        return decisions + [self._reply(event.op_id, 200, "", version_id)]

    def _make_room(self, event: ev.AdapterLoadRequested, old_version_id: int) -> Decisions:
        """A new on-demand version past the bound: the least recently used idle one is unregistered."""
        if not event.on_demand or not marks.is_full(self, old_version_id):
            return []
        victim = marks.lru_idle(self, old_version_id)
        if victim is None:
            raise RuntimeError("no idle on-demand adapter to unregister: the load should have been refused")
        del self.registry[victim.name]
        return [ev.AdapterUnloaded(victim.name, victim.version_id, marks.LRU_REASON)] + self._unregister(
            victim.version_id
        )

    def unload(self, event: ev.AdapterUnloadRequested) -> Decisions:
        if not self.config.enable_lora:
            return [
                self._reply(
                    event.op_id, 400, "LoRA is disabled; start the server with --enable-lora to unload adapters."
                )
            ]
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
        version.pinned = False  # the pin goes with the registration
        index = self.slots.find(version_id)
        if version.num_reqs == 0 and not self.slots.is_loading(index):
            return self.drop(version_id)
        return [ev.AdapterEvictionDeferred(version_id, index, version.num_reqs)]

    def drop(self, version_id: int) -> Decisions:
        """Free the slot and the CPU copy of an unregistered version nobody holds; one whose
        slot still loads is dropped when that load ends (movement.py)."""
        decisions: Decisions = []
        index = self.slots.find(version_id)
        if self.slots.is_loading(index):
            return []
        if index >= 0:
            self.slots.evict(index)
            decisions.append(ev.AdapterEvicted(index, version_id))
        if version_id in self.cpu_last_used_step:
            decisions.append(self.evict_cpu(version_id))
        del self.versions[version_id]
        return decisions

    def _reply(self, op_id: str, code: int, message: str, version_id: int = 0) -> ev.AdapterOpReplied:
        return ev.AdapterOpReplied(
            op_id, code, message, version_id, self.infos() if self.config.policy.op_reply_registry else []
        )

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
            return self.drop(req.version_id)
        return []

    # ------------------------------------------------------------------ building a step

    def bind_step(self, reqs: list[Request], preempted: list[Request], step: int) -> Decisions:
        """Give this step's requests their slots. Preempted requests unpin first. Reference
        path: every adapter the step needs is known before any slot is chosen, so no victim
        is needed. Overlapped loading: admission took only requests whose slot is ready, so
        this pins and never assigns or evicts."""
        for req in preempted:
            if req.lora_slot >= 0:
                self.slots.unpin(req.lora_slot)
                req.lora_slot = -1
        needed = distinct([req.version_id for req in reqs if req.version_id])
        decisions: Decisions = []
        for version_id in needed:
            decisions += (
                self._use_slot(version_id, step)
                if self.config.lora_overlap_loading
                else self._ensure_slot(version_id, needed, step)
            )
        for req in reqs:
            if req.version_id and req.lora_slot < 0:
                req.lora_slot = self.slots.find(req.version_id)
                self.slots.pin(req.lora_slot)
        return decisions if self.config.lora_overlap_loading else decisions + self._trim_cpu_tier()

    def _use_slot(self, version_id: int, step: int) -> Decisions:
        if not self.slots.is_ready(version_id):
            raise RuntimeError(f"adapter version {version_id} was scheduled before its slot is ready on every rank")
        self.slots.touch(self.slots.find(version_id), step)
        self.cpu_last_used_step[version_id] = step
        return []

    def _ensure_slot(self, version_id: int, needed: list[int], step: int) -> Decisions:
        decisions: Decisions = []
        index = self.slots.find(version_id)
        if index < 0:
            victim = lru_victim(self.slots.slots, needed + self.pinned_versions())
            if victim is None:
                raise RuntimeError(
                    f"no GPU slot for adapter version {version_id}: the step holds more than max_loras adapters"
                )
            index = victim.index
            if victim.state == SlotState.LOADED:
                decisions.append(ev.AdapterEvicted(index, self.slots.evict(index)))
            self.slots.assign(index, version_id, step)
            decisions.append(self._slot_assigned(index, version_id))
        self.slots.touch(index, step)
        self.cpu_last_used_step[version_id] = step
        return decisions

    def _trim_cpu_tier(self) -> Decisions:
        """Above max_cpu_loras, the LRU versions not in a GPU slot leave the CPU tier."""
        decisions: Decisions = []
        while len(self.cpu_last_used_step) > self.config.max_cpu_loras:
            candidates = [v for v in sorted(self.cpu_last_used_step) if self.slots.find(v) < 0]
            victim = min(candidates, key=lambda v: (self.cpu_last_used_step[v], v))
            decisions.append(self.evict_cpu(victim))
        return decisions

    # ------------------------------------------------------------------ overlapped movement

    def take_slot(self, slot: Slot, version_id: int, step: int) -> Decisions:
        """Reference path: evict `slot`'s version if it holds one and assign `version_id` at once
        (the workers load in command order); the CPU tier is trimmed after."""
        decisions: Decisions = [self.evict_slot(slot)] if slot.state == SlotState.LOADED else []
        self.slots.assign(slot.index, version_id, step)
        self.cpu_last_used_step[version_id] = step
        return decisions + [self._slot_assigned(slot.index, version_id)] + self._trim_cpu_tier()

    def evict_slot(self, slot: Slot) -> ev.AdapterEvicted:
        return ev.AdapterEvicted(slot.index, self.slots.evict(slot.index))

    def start_slot_load(self, slot: Slot, version_id: int, step: int) -> ev.AdapterSlotAssigned:
        """Load `version_id` into a FREE slot; it enters the CPU tier (the caller made room)."""
        if version_id not in self.cpu_last_used_step and len(self.cpu_last_used_step) >= self.config.max_cpu_loras:
            raise RuntimeError(f"adapter version {version_id} would overfill the CPU tier")
        self.slots.start_load(slot.index, version_id, step)
        self.cpu_last_used_step[version_id] = step
        return self._slot_assigned(slot.index, version_id)

    def stage(self, version_id: int, step: int) -> ev.AdapterPrefetched:
        """Stage a version into the workers' CPU tier (the caller made room)."""
        if len(self.cpu_last_used_step) >= self.config.max_cpu_loras:
            raise RuntimeError(f"adapter version {version_id} would overfill the CPU tier")
        version = self.versions[version_id]
        self.cpu_last_used_step[version_id] = step
        return ev.AdapterPrefetched(version_id, version.path, version.content_digest, version.content_sha256)

    def evict_cpu(self, version_id: int) -> ev.AdapterCpuEvicted:
        if self.slots.find(version_id) >= 0:
            raise RuntimeError(f"adapter version {version_id} would leave the CPU tier while in a GPU slot")
        del self.cpu_last_used_step[version_id]
        self.cpu_staged_ranks.pop(version_id, None)
        return ev.AdapterCpuEvicted(version_id)

    def _slot_assigned(self, index: int, version_id: int) -> ev.AdapterSlotAssigned:
        version = self.versions[version_id]
        return ev.AdapterSlotAssigned(index, version_id, version.path, version.content_digest, version.content_sha256)

    # ------------------------------------------------------------------ checks and views

    def check_integrity(self, live_reqs: list[Request]) -> None:
        adapter_views.check_adapters(self, live_reqs)

    def rows(self) -> list[Any]:
        return adapter_views.rows(self)

    def snapshot(self) -> dict[str, Any]:
        return adapter_views.snapshot(self)
