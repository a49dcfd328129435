"""Per-adapter figures folded from the event log: `AdapterStats.fold(event)` takes every
logged record in log order (inputs and decisions alike), so the same figures come out of
the running scheduler (which folds what it logs and sends the result to /metrics) and of
`ledgerserve replay --show adapters` (which folds the log). Sans-IO and deterministic:
wall-clock figures come only from times the log holds.

- A *load* is a slot load (AdapterSlotAssigned) reported done by every rank: it counts
  once, with the slowest rank's duration and "disk" as its source if any rank read the
  files. A *staging* is an AdapterPrefetched reported done by every rank.
- A version is on the GPU while its slot is ready (every rank loaded it; at once without
  overlapped loading, as the core sees it, so such waits have no ms), in the CPU tier once
  every rank staged it (until AdapterCpuEvicted), else on disk.
- An adapter request is a *hit* when its version was ready at its arrival and stayed so
  until its first plan; else a *miss*, whose wait runs from its arrival to the moment its
  version last became ready before that plan: in planned steps, and in ms where the log has
  both times (the request's arrival_time_s, the load's end_time_s on the slowest rank).
- Figures are kept per adapter name while it is registered, from zero at registration; a
  load_inplace keeps them. Requests or loads that end after their name was unloaded are
  not counted, as in /metrics.
"""

from __future__ import annotations

from typing import Any

from ledgerserve.scheduler_proc.views.adapter_figures import (
    AdapterFigures,
    LoadRecord,
    PendingLoad,
    ReqState,
    ReqWait,
    VersionState,
)
from ledgerserve.shared import events as ev

__all__ = ["AdapterFigures", "AdapterStats", "LoadRecord", "ReqWait"]


class AdapterStats:
    def __init__(self, num_ranks: int, overlap_loading: bool, keep_waits: bool = False) -> None:
        self.num_ranks = num_ranks
        self.overlap_loading = overlap_loading
        self.keep_waits = keep_waits  # keep every finished request's wait (replay), not only the live ones
        self.step = 0  # the newest planned step
        self.figures: dict[str, AdapterFigures] = {}  # registered names
        self.finished_waits: list[ReqWait] = []
        self.lora_wait_ms = 0.0  # every counted timed wait, summed
        self._versions: dict[int, VersionState] = {}
        self._pending: dict[tuple[int, int], PendingLoad] = {}  # (slot or -1, version) -> a load in progress
        self._reqs: dict[str, ReqState] = {}  # live adapter requests
        self._num_registrations = 0
        self._duplicate_id: str | None = None  # an arrival whose id is in use: its rejection is not ours
        self._changed: list[str] = []  # names whose row changed since take_changed_rows
        self._load_asked: ev.AdapterLoadRequested | None = None  # the load whose decisions come next

    # ------------------------------------------------------------------ views

    def take_changed_rows(self) -> list[ev.AdapterRow]:
        names, self._changed = self._changed, []
        return [self.row(name) for name in names if name in self.figures]

    def row(self, name: str) -> ev.AdapterRow:
        fig = self.figures[name]
        return ev.AdapterRow(
            fig.name,
            fig.version_id,
            self.tier(fig.version_id),
            fig.pinned,
            fig.num_running,
            fig.num_waiting,
            fig.num_prompt_tokens,
            fig.num_generated_tokens,
            fig.num_cached_tokens,
        )

    def tier(self, version_id: int) -> str:
        version = self._versions.get(version_id)
        if version is not None and version.is_ready:
            return "gpu"
        if version is not None and len(version.staged_ranks) == self.num_ranks:
            return "cpu"
        return "disk"

    def live_waits(self) -> list[ReqWait]:
        """Each live adapter request's wait: final once planned, so far while it waits."""
        return [req.wait or self._wait_so_far(req) for req in self._reqs.values()]

    # ------------------------------------------------------------------ fold

    def fold(self, event: Any) -> list[LoadRecord]:
        """Take one logged record; returns the loads it completed (of registered names)."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            return []
        return handler(self, event) or []

    def _on_registered(self, event: ev.AdapterRegistered) -> None:
        fig = self.figures.get(event.name)
        if fig is None:
            self._num_registrations += 1
            fig = self.figures[event.name] = AdapterFigures(event.name, event.version_id, self._num_registrations)
        old = self._versions.get(event.replaced_version_id)
        if old is not None:
            old.is_current = False
            self._forget_if_idle(old)
        fig.version_id = event.version_id
        asked = self._load_asked
        fig.pinned = asked is not None and asked.name == event.name and asked.pinned  # a pin goes with its version
        self._versions[event.version_id] = VersionState(event.version_id, event.name, fig.registration)
        self._mark(event.name)

    def _on_unloaded(self, event: ev.AdapterUnloaded) -> None:
        self.figures.pop(event.name, None)
        version = self._versions.get(event.version_id)
        if version is not None:
            version.is_current = False
            self._forget_if_idle(version)

    def _on_load_requested(self, event: ev.AdapterLoadRequested) -> None:
        self._load_asked = event

    def _on_slot_assigned(self, event: ev.AdapterSlotAssigned) -> None:
        version = self._versions.get(event.version_id)
        if version is None:
            return
        version.slot, version.in_cpu_tier = event.slot, True
        self._pending[(event.slot, event.version_id)] = PendingLoad()
        if not self.overlap_loading:
            self._became_ready(version, 0.0)  # the workers load it before the step that uses it

    def _on_prefetched(self, event: ev.AdapterPrefetched) -> None:
        version = self._versions.get(event.version_id)
        if version is not None:
            version.in_cpu_tier = True
            self._pending[(-1, event.version_id)] = PendingLoad()

    def _on_load_completed(self, event: ev.AdapterLoadCompleted) -> list[LoadRecord]:
        version = self._versions.get(event.version_id)
        pending = self._pending.get((event.slot, event.version_id))
        if version is None or pending is None or event.rank in pending.ranks or not 0 <= event.rank < self.num_ranks:
            return []  # stale, repeated, or of a version the log no longer tracks
        pending.ranks.append(event.rank)
        pending.duration_ms = max(pending.duration_ms, event.duration_ms)
        pending.end_time_s = max(pending.end_time_s, event.end_time_s)
        if event.source_tier == "disk":
            pending.source_tier = "disk"
        if version.in_cpu_tier and event.rank not in version.staged_ranks:
            version.staged_ranks = sorted(version.staged_ranks + [event.rank])
            self._mark_version(version)
        if len(pending.ranks) < self.num_ranks:
            return []
        del self._pending[(event.slot, event.version_id)]
        return self._load_done(version, event.slot, pending)

    def _load_done(self, version: VersionState, slot: int, pending: PendingLoad) -> list[LoadRecord]:
        if slot >= 0 and self.overlap_loading and version.slot == slot:
            self._became_ready(version, pending.end_time_s)
        fig = self._figures_of(version)
        if fig is None:
            self._forget_if_idle(version)
            return []
        if slot < 0:
            fig.num_stagings += 1
            return []
        record = LoadRecord(version.name, version.version_id, pending.source_tier, pending.duration_ms)
        fig.add_load(record)
        return [record]

    def _on_load_failed(self, event: ev.AdapterLoadFailed) -> None:
        self._pending.pop((event.slot, event.version_id), None)

    def _on_evicted(self, event: ev.AdapterEvicted) -> None:
        version = self._versions.get(event.version_id)
        if self.overlap_loading:
            self._pending.pop((event.slot, event.version_id), None)  # only a failed load is evicted mid-load
        if version is None or version.slot != event.slot:
            return
        version.slot, version.is_ready = -1, False
        self._mark_version(version)
        self._forget_if_idle(version)

    def _on_cpu_evicted(self, event: ev.AdapterCpuEvicted) -> None:
        self._pending.pop((-1, event.version_id), None)
        version = self._versions.get(event.version_id)
        if version is None:
            return
        version.in_cpu_tier, version.staged_ranks = False, []
        self._mark_version(version)
        self._forget_if_idle(version)

    def _became_ready(self, version: VersionState, end_time_s: float) -> None:
        version.is_ready = True
        version.num_readies += 1
        version.ready_step, version.ready_time_s = self.step, end_time_s
        self._mark_version(version)

    # ------------------------------------------------------------------ requests

    def _on_arrived(self, event: ev.RequestArrived) -> None:
        if event.req_id in self._reqs:
            self._duplicate_id = event.req_id
            return
        fig = self.figures.get(event.lora_name) if event.lora_name is not None else None
        version = self._versions.get(fig.version_id) if fig is not None else None
        if fig is None or version is None:
            return  # the base model, or an unknown adapter (rejected)
        self._reqs[event.req_id] = ReqState(
            event.req_id,
            fig.name,
            version.version_id,
            fig.registration,
            self.step,
            event.arrival_time_s,
            len(event.prompt_token_ids),
            version.is_ready,
            version.num_readies,
        )
        version.num_reqs += 1
        fig.num_waiting += 1
        self._mark(fig.name)

    def _on_plan(self, event: ev.StepPlan) -> None:
        self.step = event.step
        for new in event.new_reqs:
            req = self._reqs.get(new.req_id)
            if req is None or req.is_running:
                continue
            if req.wait is None:
                req.wait = self._first_plan_wait(req)
                self._count_wait(req, req.wait)
            self._set_running(req, True)

    def _first_plan_wait(self, req: ReqState) -> ReqWait:
        version = self._versions[req.version_id]
        name = req.name
        if req.was_ready and version.num_readies == req.num_readies:
            return ReqWait(req.req_id, name, True, 0, 0.0 if req.arrival_time_s else None)
        wait_ms = None
        if req.arrival_time_s and version.ready_time_s:
            wait_ms = max(0.0, (version.ready_time_s - req.arrival_time_s) * 1000.0)
        return ReqWait(req.req_id, name, False, max(0, version.ready_step - req.arrival_step), wait_ms)

    def _count_wait(self, req: ReqState, wait: ReqWait) -> None:
        fig = self._counted(req)
        if fig is not None:
            fig.add_wait(wait)
            self.lora_wait_ms += wait.wait_ms or 0.0

    def _on_preempted(self, event: ev.RequestPreempted) -> None:
        req = self._reqs.get(event.req_id)
        if req is not None and req.is_running:
            self._set_running(req, False)

    def _on_emitted(self, event: ev.TokensEmitted) -> None:
        req = self._reqs.get(event.req_id)
        if req is not None:
            req.num_cached_tokens = event.num_cached_tokens

    def _on_finished(self, event: ev.RequestFinished) -> None:
        req = self._end(event.req_id)
        fig = self._counted(req) if req is not None else None
        if req is None or fig is None:
            return
        fig.num_prompt_tokens += req.num_prompt_tokens
        fig.num_generated_tokens += event.num_output_tokens
        fig.num_cached_tokens += req.num_cached_tokens

    def _on_rejected(self, event: ev.RequestRejected) -> None:
        if event.req_id == self._duplicate_id:
            self._duplicate_id = None
            return
        self._end(event.req_id)

    def _end(self, req_id: str) -> ReqState | None:
        req = self._reqs.pop(req_id, None)
        if req is None:
            return None
        if self.keep_waits:
            self.finished_waits.append(req.wait or self._wait_so_far(req))
        fig = self._counted(req)
        if fig is not None:
            fig.num_running -= int(req.is_running)
            fig.num_waiting -= int(not req.is_running)
            self._mark(fig.name)
        version = self._versions[req.version_id]
        version.num_reqs -= 1
        self._forget_if_idle(version)
        return req

    def _set_running(self, req: ReqState, is_running: bool) -> None:
        req.is_running = is_running
        fig = self._counted(req)
        if fig is not None:
            fig.num_running += 1 if is_running else -1
            fig.num_waiting += -1 if is_running else 1
            self._mark(fig.name)

    def _wait_so_far(self, req: ReqState) -> ReqWait:
        version = self._versions[req.version_id]
        if req.was_ready and version.num_readies == req.num_readies:
            steps = 0
        else:
            steps = (version.ready_step if version.is_ready else self.step) - req.arrival_step
        return ReqWait(req.req_id, req.name, None, max(0, steps), None)

    # ------------------------------------------------------------------ helpers

    def _counted(self, req: ReqState) -> AdapterFigures | None:
        """The figures a request counts in: its name's, while the registration it arrived under lasts."""
        fig = self.figures.get(req.name)
        return fig if fig is not None and fig.registration == req.registration else None

    def _figures_of(self, version: VersionState) -> AdapterFigures | None:
        fig = self.figures.get(version.name)
        return fig if fig is not None and fig.registration == version.registration else None

    def _mark(self, name: str) -> None:
        if name not in self._changed:
            self._changed.append(name)

    def _mark_version(self, version: VersionState) -> None:
        if version.is_current and self._figures_of(version) is not None:
            self._mark(version.name)

    def _forget_if_idle(self, version: VersionState) -> None:
        """A version no longer current, in no slot or CPU tier, loading nowhere and held by no request."""
        if version.is_current or version.slot >= 0 or version.in_cpu_tier or version.num_reqs:
            return
        if any(key[1] == version.version_id for key in self._pending):
            return
        del self._versions[version.version_id]


_HANDLERS = {
    ev.AdapterRegistered: AdapterStats._on_registered,
    ev.AdapterUnloaded: AdapterStats._on_unloaded,
    ev.AdapterLoadRequested: AdapterStats._on_load_requested,
    ev.AdapterSlotAssigned: AdapterStats._on_slot_assigned,
    ev.AdapterPrefetched: AdapterStats._on_prefetched,
    ev.AdapterLoadCompleted: AdapterStats._on_load_completed,
    ev.AdapterLoadFailed: AdapterStats._on_load_failed,
    ev.AdapterEvicted: AdapterStats._on_evicted,
    ev.AdapterCpuEvicted: AdapterStats._on_cpu_evicted,
    ev.RequestArrived: AdapterStats._on_arrived,
    ev.StepPlan: AdapterStats._on_plan,
    ev.RequestPreempted: AdapterStats._on_preempted,
    ev.TokensEmitted: AdapterStats._on_emitted,
    ev.RequestFinished: AdapterStats._on_finished,
    ev.RequestRejected: AdapterStats._on_rejected,
}
