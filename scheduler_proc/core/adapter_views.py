"""The adapter manager's integrity checks and its plain-data views (the StateDigest rows
and the snapshot `replay --show` prints). Pure reads of the manager's state."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ledgerserve.scheduler_proc.core.request import Request, RequestStatus
from ledgerserve.scheduler_proc.core.slots import Slot, SlotState, SlotTable

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.adapters import AdapterManager, AdapterVersion


def check_adapters(manager: AdapterManager, live_reqs: list[Request]) -> None:
    """Pins match the running requests, every slot's version is live and in the CPU tier,
    request counts and the registry agree, the CPU tier stays within max_cpu_loras."""
    num_pins = [0] * len(manager.slots.slots)
    num_reqs: dict[int, int] = {}
    for req in live_reqs:
        _check_req_slot(req, manager.slots)
        if req.lora_slot >= 0:
            num_pins[req.lora_slot] += 1
        if req.version_id:
            num_reqs[req.version_id] = num_reqs.get(req.version_id, 0) + 1
    for slot in manager.slots.slots:
        _check_slot(
            slot, num_pins[slot.index], manager.versions.get(slot.version_id), manager.config.tensor_parallel_size
        )
        if slot.state != SlotState.FREE and (
            manager.slots.find(slot.version_id) != slot.index or slot.version_id not in manager.cpu_last_used_step
        ):
            raise RuntimeError(f"slot {slot.index}: version {slot.version_id} is in two slots or not in the CPU tier")
    if not manager.config.lora_overlap_loading and (manager.slots.num_loading or manager.cpu_staged_ranks):
        raise RuntimeError("a slot loads, or a staging is tracked, with overlapped loading off")
    _check_drains(manager, live_reqs)
    for version_id in sorted(manager.versions):
        version = manager.versions[version_id]
        if version.num_reqs != num_reqs.get(version_id, 0):
            raise RuntimeError(
                f"adapter version {version_id} counts {version.num_reqs} requests, "
                f"{num_reqs.get(version_id, 0)} hold it"
            )
        if version.is_registered != (manager.registry.get(version.name) == version_id):
            raise RuntimeError(f"adapter version {version_id} and the registry disagree")
    for name in sorted(manager.registry):
        if manager.registry[name] not in manager.versions:
            raise RuntimeError(f"the registry maps {name!r} to a dropped version")
    _check_cpu_tier(manager)
    _check_marks(manager)


def _check_marks(manager: AdapterManager) -> None:
    """User pins only on registered versions, at most max_loras - 1; registered on-demand
    versions within max_on_demand_loras, each used at a distinct tick of the use clock."""
    pinned = manager.pinned_versions()
    if len(pinned) > manager.config.max_loras - 1 or any(not manager.versions[v].is_registered for v in pinned):
        raise RuntimeError(f"pinned versions {pinned}: more than max_loras - 1, or one not registered")
    marked = [manager.versions[v] for v in sorted(manager.versions) if manager.versions[v].on_demand]
    registered = [v for v in marked if v.is_registered]
    if len(registered) > manager.config.max_on_demand_loras:
        raise RuntimeError(f"{len(registered)} on-demand versions registered > max_on_demand_loras")
    ticks = sorted(v.last_used for v in marked)
    if not all(a < b for a, b in pairwise(ticks)) or any(not 0 < t <= manager.num_uses for t in ticks):
        raise RuntimeError(f"on-demand use ticks {ticks} are not distinct values in 1..{manager.num_uses}")


def _check_drains(manager: AdapterManager, live_reqs: list[Request]) -> None:
    """Only with targeted drains, and for a version a waiting request holds: a LOADED or PINNED
    slot drains for a version in no slot, or a LOADING or LOADED slot is reserved for the
    version it holds; one mark per version."""
    targets: list[int] = []
    for slot in manager.slots.slots:
        target = slot.drain_for_version_id
        if not target:
            continue
        waits = any(r.version_id == target and r.status == RequestStatus.WAITING for r in live_reqs)
        if target == slot.version_id:
            is_kept = slot.state in (SlotState.LOADING, SlotState.LOADED)
        else:
            is_kept = slot.state in (SlotState.LOADED, SlotState.PINNED) and manager.slots.find(target) < 0
        if not (manager.config.drains_slots and is_kept and waits) or target in targets:
            raise RuntimeError(
                f"slot {slot.index} ({slot.state.name}, version {slot.version_id}) drains for "
                f"version {target}: not a mark the policy keeps"
            )
        targets.append(target)


def _check_cpu_tier(manager: AdapterManager) -> None:
    tier = manager.cpu_last_used_step
    if len(tier) > manager.config.max_cpu_loras:
        raise RuntimeError(f"the CPU tier holds {len(tier)} versions > max_cpu_loras {manager.config.max_cpu_loras}")
    for version_id in sorted(tier):
        if version_id not in manager.versions:
            raise RuntimeError(f"the CPU tier holds dropped version {version_id}")
    for version_id in sorted(manager.cpu_staged_ranks):
        ranks = manager.cpu_staged_ranks[version_id]
        if (
            version_id not in tier
            or not _ascending(ranks)
            or not 0 <= ranks[0] <= ranks[-1] < manager.config.tensor_parallel_size
        ):
            raise RuntimeError(
                f"version {version_id} is noted staged on ranks {ranks}: "
                "not in the CPU tier, or ranks out of order or range"
            )


def _check_req_slot(req: Request, slots: SlotTable) -> None:
    running = req.status == RequestStatus.RUNNING
    if req.version_id and running and (req.lora_slot < 0 or slots.slots[req.lora_slot].version_id != req.version_id):
        raise RuntimeError(f"running request {req.req_id!r} of version {req.version_id} is in slot {req.lora_slot}")
    if req.lora_slot >= 0 and not (running and req.version_id):
        raise RuntimeError(
            f"request {req.req_id!r} ({req.status.name}, version {req.version_id}) holds slot {req.lora_slot}"
        )


def _check_slot(slot: Slot, num_pins: int, version: AdapterVersion | None, num_ranks: int) -> None:
    if slot.num_pins != num_pins or (slot.state == SlotState.PINNED) != (num_pins > 0):
        raise RuntimeError(
            f"slot {slot.index} ({slot.state.name}) has {slot.num_pins} pins, {num_pins} running requests use it"
        )
    loading = slot.state == SlotState.LOADING
    if slot.ready_ranks and (not loading or len(slot.ready_ranks) >= num_ranks or not _ascending(slot.ready_ranks)):
        raise RuntimeError(f"slot {slot.index} ({slot.state.name}) lists ranks {slot.ready_ranks} done of {num_ranks}")
    if slot.state == SlotState.FREE:
        if slot.version_id:
            raise RuntimeError(f"free slot {slot.index} names version {slot.version_id}")
        return
    if version is None:
        raise RuntimeError(f"slot {slot.index} holds dropped version {slot.version_id}")
    if not version.is_registered and version.num_reqs == 0 and not loading:
        raise RuntimeError(f"slot {slot.index} holds unregistered version {slot.version_id} that no request holds")


def rows(manager: AdapterManager) -> list[Any]:
    """The StateDigest's adapter rows. Which ranks reported a slot load in flight, or a CPU-tier
    staging, decides nothing (a slot is used once every rank reported it, and its state is in the
    slot rows): their timing is the workers', so they are left out, and two runs of the same
    traffic digest alike. Logs of schema 5 and before hashed them (`Policy.digest_load_reports`), with
    overlapped loading and LoRA on."""
    tier = manager.cpu_last_used_step
    out: list[Any] = [
        [[name, manager.registry[name]] for name in sorted(manager.registry)],
        [[v.version_id, v.name, v.path, v.is_registered, v.num_reqs] for v in _sorted_versions(manager)],
        manager.slots.rows(),
        [[v, tier[v]] for v in sorted(tier)],
    ]
    if manager.config.policy.digest_load_reports and manager.config.lora_overlap_loading and manager.config.enable_lora:
        out.append([[s.index, list(s.ready_ranks)] for s in manager.slots.slots if s.state == SlotState.LOADING])
        out.append([[v, list(manager.cpu_staged_ranks[v])] for v in sorted(manager.cpu_staged_ranks)])
    if manager.config.drains_slots and manager.config.enable_lora:
        out.append(manager.slots.drain_rows())
    marks = [
        [v.version_id, v.pinned, v.on_demand, v.last_used] for v in _sorted_versions(manager) if v.pinned or v.on_demand
    ]
    if marks:  # user pins and on-demand marks; absent when there are none, as in older logs' digests
        out.append([marks, manager.num_uses])
    return out


def snapshot(manager: AdapterManager) -> dict[str, Any]:
    tier = manager.cpu_last_used_step
    num_ranks = manager.config.tensor_parallel_size
    return {
        "registry": {name: manager.registry[name] for name in sorted(manager.registry)},
        "versions": [
            {
                "version_id": v.version_id,
                "name": v.name,
                "path": v.path,
                "is_registered": v.is_registered,
                "num_reqs": v.num_reqs,
                "pinned": v.pinned,
                "on_demand": v.on_demand,
                "last_used": v.last_used,
                "lineage_id": v.lineage_id,
            }
            for v in _sorted_versions(manager)
        ],
        "slots": [
            {
                "slot": s.index,
                "state": s.state.name,
                "version_id": s.version_id,
                "num_pins": s.num_pins,
                "last_used_step": s.last_used_step,
            }
            for s in manager.slots.slots
        ],
        "cpu_tier": [[v, tier[v]] for v in sorted(tier)],
        "deferred_evictions": [v.version_id for v in _sorted_versions(manager) if not v.is_registered],
        "pinned": manager.pinned_versions(),
        "on_demand_use_clock": manager.num_uses,
        "loads_in_flight": [
            {"slot": s.index, "version_id": s.version_id, "ready_ranks": list(s.ready_ranks)}
            for s in manager.slots.slots
            if s.state == SlotState.LOADING
        ],
        "drains": [
            {"slot": row[0], "version_id": row[1], "for_version_id": row[2]} for row in manager.slots.drain_rows()
        ],
        "cpu_tier_bytes": manager.cpu_tier_bytes,
        "cpu_staged_on_every_rank": [
            v for v in sorted(manager.cpu_staged_ranks) if len(manager.cpu_staged_ranks[v]) == num_ranks
        ],
    }


def _ascending(ranks: list[int]) -> bool:
    return all(a < b for a, b in pairwise(ranks))


def _sorted_versions(manager: AdapterManager) -> list[AdapterVersion]:
    return [manager.versions[v] for v in sorted(manager.versions)]
