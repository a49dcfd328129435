"""The sans-IO scheduler core: `Core.apply(event) -> Decisions` (decisions.py).

Deterministic by construction: no clock, no randomness, no set iteration, no `hash()`;
dicts are only used for lookups; every order comes from the input sequence or from
`arrival_order`. The shell logs each input, applies it here, logs the decisions, sends them.
`apply` is the one dispatch; the workers' reports (worker_reports.py), the adapter inputs
(movement.py) and how a request ends (finish.py) are functions of the core beside it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ledgerserve.scheduler_proc.core import (
    digest,
    drain,
    finish,
    movement,
    on_demand,
    pins,
    prefetch,
    prefix,
    worker_reports,
)
from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.block_manager import BlockManager
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.plan import InFlightStep, build_plan
from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.scheduler import Scheduler
from ledgerserve.shared import events as ev


class Core:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self.adapters = AdapterManager(config)
        self.requests: dict[str, Request] = {}  # live requests, lookups only
        self.ready: dict[int, ev.WorkerReady] = {}  # by rank, lookups only
        self.eos_token_ids: list[int] = []
        self.step = 0
        self.in_flight: deque[InFlightStep] = deque()  # planned, not completed; oldest first
        self.finished_req_ids: list[str] = []  # to tell workers in the next plan
        self.rank_digests: dict[int, dict[int, int]] = {}  # step -> rank -> digest
        self.last_agreed_step = 0  # every rank's digest of this step (and those before) arrived, equal
        self.failure: str | None = None
        self._num_arrived = 0

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    def check_integrity(self) -> None:
        if self.scheduler.is_ready:
            tables = [(req.req_id, req.block_ids) for req in self.live_requests()]
            self.scheduler.block_manager.check_integrity(tables)
        for req in self.scheduler.running:
            if len(req.block_ids) * self.config.block_size < req.num_computed_tokens:
                raise RuntimeError(
                    f"{req.req_id!r} holds {len(req.block_ids)} blocks for {req.num_computed_tokens} computed tokens"
                )
        queued = self.live_requests()
        if len(queued) != len(self.requests) or any(self.requests.get(r.req_id) is not r for r in queued):
            raise RuntimeError("queues and the request table disagree")
        self.adapters.check_integrity(queued)

    def state_rows(self) -> list[Any]:
        """What the next StateDigest hashes, as plain data."""
        return digest.state_rows(
            self.step,
            self.scheduler,
            self.live_requests(),
            self.adapters,
            with_in_flight=self.config.max_steps_in_flight > 1,
        )

    def snapshot(self) -> dict[str, Any]:
        in_flight_steps = [step.step for step in self.in_flight]
        return digest.snapshot(self.step, in_flight_steps, self.scheduler, self.live_requests(), self.adapters)

    # ------------------------------------------------------------------ dispatch

    def apply(self, event: Any) -> Decisions:
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"Core.apply: not a core input: {type(event).__name__}")
        if self.failure is not None:
            return self._after_failure(event)
        decisions = handler(self, event)
        if self.scheduler.is_ready and not self.config.policy.keep_dropped_namespaces:
            prefix.forget_dropped_namespaces(self.scheduler.block_manager, self.adapters.versions)
        if self.failure is None:
            decisions += self._prefetch() + self._maybe_plan()
        return decisions

    def _after_failure(self, event: Any) -> Decisions:
        if isinstance(event, ev.RequestArrived):
            return [ev.RequestRejected(event.req_id, f"The engine has failed: {self.failure}", code=503)]
        if isinstance(event, (ev.AdapterLoadRequested, ev.AdapterUnloadRequested)):
            return [ev.AdapterOpReplied(event.op_id, 503, f"The engine has failed: {self.failure}")]
        return []

    def fail(self, message: str) -> Decisions:
        self.failure = message
        return [ev.EngineFailed(message)]

    # ------------------------------------------------------------------ inputs

    def _on_worker_ready(self, event: ev.WorkerReady) -> Decisions:
        if not 0 <= event.rank < self.config.tensor_parallel_size:
            return self.fail(
                f"WorkerReady from rank {event.rank}, but tensor_parallel_size is {self.config.tensor_parallel_size}"
            )
        if event.rank in self.ready:
            return self.fail(f"rank {event.rank} reported ready twice")
        self.ready[event.rank] = event
        if len(self.ready) < self.config.tensor_parallel_size:
            return []
        ranks = [self.ready[rank] for rank in range(self.config.tensor_parallel_size)]
        num_blocks = min(r.num_kv_blocks for r in ranks)
        if num_blocks <= 0:
            return self.fail(f"the workers found no room for KV blocks (num_kv_blocks={num_blocks})")
        self.eos_token_ids = list(ranks[0].eos_token_ids)
        self.scheduler.attach(BlockManager(num_blocks, self.config.block_size))
        decisions: Decisions = []
        for req in list(self.scheduler.waiting):  # those that arrived before capacity was known
            decisions += finish.reject_if_unservable(self, req)
        return decisions

    def _on_request_arrived(self, event: ev.RequestArrived) -> Decisions:
        if event.req_id in self.requests or self._in_a_step_in_flight(event.req_id):
            return [
                ev.RequestRejected(event.req_id, f"Request id {event.req_id!r} is already in use.", param="request_id")
            ]
        registered, version_id = self._adapter_of(event)
        if version_id is None:
            return registered
        self.adapters.note_use(version_id)
        self._num_arrived += 1
        req = Request(
            event.req_id,
            event.prompt_token_ids,
            event.sampling,
            self._num_arrived,
            event.lora_name,
            version_id,
            self.step,
        )
        self.requests[req.req_id] = req
        self.adapters.hold(req)
        self.scheduler.add(req)
        return registered + finish.reject_if_unservable(self, req)

    def _adapter_of(self, event: ev.RequestArrived) -> tuple[Decisions, int | None]:
        """(decisions, version id) of the adapter a request names (0: the base model). The
        decisions register it again on demand (on_demand.py); with version None they are the
        request's RequestRejected."""
        if event.lora_name is None:
            return [], 0
        version_id = self.adapters.resolve(event.lora_name)
        if version_id is None and event.on_demand is not None:  # unregistered since it was resolved
            return on_demand.register_for_request(self, event)
        if version_id is None:
            message = f"The model `{event.lora_name}` does not exist."
            return [ev.RequestRejected(event.req_id, message, code=404, param="model")], None
        named = event.lora_version_id
        if (
            named
            and not self.adapters.same_adapter(version_id, named)
            and not on_demand.same_files(self, version_id, event)
        ):
            message = (
                f"The adapter `{event.lora_name}` was unloaded after this request named it, and that name now "
                f"names a newly loaded adapter; retry the request."
            )
            return [ev.RequestRejected(event.req_id, message, code=404, param="model")], None
        return [], version_id

    def _in_a_step_in_flight(self, req_id: str) -> bool:
        """A request that ended while a step holding it was in flight: that step's report would
        name it, so its id cannot name a new request before. Once no step holds it, the id is free
        again (a client's X-Request-Id, reused): the next plan drops the old one before the new one."""
        return any(item.req_id == req_id for step in self.in_flight for item in step.reqs)

    def _on_request_aborted(self, event: ev.RequestAborted) -> Decisions:
        req = self.requests.get(event.req_id)
        if req is None:
            return []  # already finished, or never known: nothing to do
        reason = event.reason if event.reason in ("abort", "stop") else "abort"
        return finish.finish(self, req, reason, [], None, None)

    # ------------------------------------------------------------------ planning

    def _prefetch(self) -> Decisions:
        """Slots for user-pinned adapters (pins.py); with overlapped loading, then slots and CPU
        staging for the head of the waiting queue, in queue order; with targeted drains, in slot
        order and with the drain pass (drain.py)."""
        if not self.scheduler.is_ready:
            return []
        busy_slots = [slot for step in self.in_flight for slot in step.lora_slots]
        waiting = self.scheduler.waiting
        decisions = pins.place(self.adapters, waiting, self.step, busy_slots)
        if not self.config.lora_overlap_loading:
            return decisions
        if self.config.drains_slots:
            return decisions + drain.movement_pass(
                self.adapters, waiting, self.scheduler.running, self.step, busy_slots
            )
        order = prefetch.lookahead(
            waiting, self.config.max_num_seqs, prefetch.LOOKAHEAD_VERSIONS_PER_SLOT * self.config.max_loras
        )
        return decisions + prefetch.prefetch(self.adapters, order, self.step, busy_slots)

    def _maybe_plan(self) -> Decisions:
        """Plan steps until `max_steps_in_flight` are in flight (1: the classic loop; 2: async
        scheduling, step s + 1 planned while step s runs) or nothing more can be scheduled."""
        decisions: Decisions = []
        while len(self.in_flight) < self.config.max_steps_in_flight and self.failure is None:
            if not self.scheduler.is_ready or not self.has_unfinished() or self._digests_lag():
                break  # a lagging rank: planned when its digest arrives
            planned = self._plan_step()
            if not planned:
                break
            decisions += planned
        return decisions

    def _plan_step(self) -> Decisions:
        """The next step's plan and what it decides, or [] when only a step in flight can make progress."""
        draining = drain.draining(self.adapters) if self.config.drains_slots else None
        scheduled, preempted = self.scheduler.schedule(
            self.step + 1, not self.in_flight, self.adapters.slot_readiness(), draining, self.adapters.pinned_in_slots()
        )
        if not scheduled:
            if self.in_flight or self.adapters.slots.num_loading:
                return []  # planned when a step completes or a load ends
            return self.fail(f"the scheduler can make no progress: {len(self.scheduler.waiting)} waiting, nothing fits")
        self.step += 1
        preempted_ids = [req.req_id for req in preempted]
        decisions: Decisions = [ev.RequestPreempted(req_id, self.step) for req_id in preempted_ids]
        decisions += self.adapters.bind_step([item.req for item in scheduled], preempted, self.step)
        plan, in_flight = build_plan(self.step, scheduled, self.finished_req_ids, preempted_ids)
        self.in_flight.append(in_flight)
        self.finished_req_ids = []
        return decisions + [plan, ev.StateDigest(self.step, digest.state_digest(self.state_rows()))]

    def _digests_lag(self) -> bool:
        """With several ranks the core takes rank 0's tokens, so a slow rank's digest could trail
        by any number of steps and a disagreement surface after its requests finished. Step s + 1
        is planned only once every rank agreed on step s - 1: at most two steps' tokens go out
        before a disagreement stops the engine, and ranks in lockstep never wait (each rank sends
        step s's digest as it finishes step s)."""
        return self.config.tensor_parallel_size > 1 and self.last_agreed_step < self.step - 1

    def live_requests(self) -> list[Request]:
        return list(self.scheduler.waiting) + self.scheduler.running


_HANDLERS = {
    ev.WorkerReady: Core._on_worker_ready,
    ev.RequestArrived: Core._on_request_arrived,
    ev.RequestAborted: Core._on_request_aborted,
    ev.StepCompleted: worker_reports.on_step_completed,
    ev.RankDigest: worker_reports.on_rank_digest,
    ev.WorkerFailed: worker_reports.on_worker_failed,
    ev.AdapterLoadRequested: movement.on_adapter_load_requested,
    ev.AdapterUnloadRequested: movement.on_adapter_unload_requested,
    ev.AdapterLoadCompleted: movement.on_adapter_load_completed,
    ev.AdapterLoadFailed: movement.on_adapter_load_failed,
}
