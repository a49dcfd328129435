"""The sans-IO scheduler core: `Core.apply(event) -> list[Decision]`.

Deterministic by construction: no clock, no randomness, no set iteration, no `hash()`;
dicts are only used for lookups; every order comes from the input sequence or from
`arrival_order`. The shell logs each input, applies it here, logs the decisions, sends them.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ledgerserve.scheduler_proc.core import digest, drain, movement, pins, prefetch, prefix, prompt_logprobs
from ledgerserve.scheduler_proc.core.adapters import AdapterManager
from ledgerserve.scheduler_proc.core.block_manager import BlockManager
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.finish import admission_error, check_stop
from ledgerserve.scheduler_proc.core.plan import InFlightStep, build_plan
from ledgerserve.scheduler_proc.core.request import FINISH_REASON_TO_STATUS, Request, RequestStatus, transition
from ledgerserve.scheduler_proc.core.scheduler import Scheduler
from ledgerserve.shared import events as ev

Decisions = list[Any]  # list[events.Decision]


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
            tables = [(req.req_id, req.block_ids) for req in self._live_requests()]
            self.scheduler.block_manager.check_integrity(tables)
        for req in self.scheduler.running:
            if len(req.block_ids) * self.config.block_size < req.num_computed_tokens:
                raise RuntimeError(
                    f"{req.req_id!r} holds {len(req.block_ids)} blocks for {req.num_computed_tokens} computed tokens"
                )
        queued = list(self.scheduler.waiting) + self.scheduler.running
        if len(queued) != len(self.requests) or any(self.requests.get(r.req_id) is not r for r in queued):
            raise RuntimeError("queues and the request table disagree")
        self.adapters.check_integrity(queued)

    def state_rows(self) -> list[Any]:
        """What the next StateDigest hashes, as plain data."""
        return digest.state_rows(
            self.step,
            self.scheduler,
            self._live_requests(),
            self.adapters,
            with_in_flight=self.config.max_steps_in_flight > 1,
        )

    def snapshot(self) -> dict[str, Any]:
        in_flight_steps = [step.step for step in self.in_flight]
        return digest.snapshot(self.step, in_flight_steps, self.scheduler, self._live_requests(), self.adapters)

    # ------------------------------------------------------------------ dispatch

    def apply(self, event: Any) -> Decisions:
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise TypeError(f"Core.apply: not a core input: {type(event).__name__}")
        if self.failure is not None:
            return self._after_failure(event)
        decisions = handler(self, event)
        if self.scheduler.is_ready and not self.config.keep_dropped_namespaces:
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

    def _fail(self, message: str) -> Decisions:
        self.failure = message
        return [ev.EngineFailed(message)]

    # ------------------------------------------------------------------ inputs

    def _on_worker_ready(self, event: ev.WorkerReady) -> Decisions:
        if not 0 <= event.rank < self.config.tensor_parallel_size:
            return self._fail(
                f"WorkerReady from rank {event.rank}, but tensor_parallel_size is {self.config.tensor_parallel_size}"
            )
        if event.rank in self.ready:
            return self._fail(f"rank {event.rank} reported ready twice")
        self.ready[event.rank] = event
        if len(self.ready) < self.config.tensor_parallel_size:
            return []
        ranks = [self.ready[rank] for rank in range(self.config.tensor_parallel_size)]
        num_blocks = min(r.num_kv_blocks for r in ranks)
        if num_blocks <= 0:
            return self._fail(f"the workers found no room for KV blocks (num_kv_blocks={num_blocks})")
        self.eos_token_ids = list(ranks[0].eos_token_ids)
        self.scheduler.attach(BlockManager(num_blocks, self.config.block_size))
        decisions: Decisions = []
        for req in list(self.scheduler.waiting):  # those that arrived before capacity was known
            decisions += self._reject_if_unservable(req)
        return decisions

    def _on_request_arrived(self, event: ev.RequestArrived) -> Decisions:
        if event.req_id in self.requests or event.req_id in self.finished_req_ids:
            return [
                ev.RequestRejected(event.req_id, f"Request id {event.req_id!r} is already in use.", param="request_id")
            ]
        version_id = 0 if event.lora_name is None else self.adapters.resolve(event.lora_name)
        if version_id is None:
            return [
                ev.RequestRejected(
                    event.req_id, f"The model `{event.lora_name}` does not exist.", code=404, param="model"
                )
            ]
        if event.lora_version_id and version_id and not self.adapters.same_adapter(version_id, event.lora_version_id):
            message = (
                f"The adapter `{event.lora_name}` was unloaded after this request named it, and that name now "
                f"names a newly loaded adapter; retry the request."
            )
            return [ev.RequestRejected(event.req_id, message, code=404, param="model")]
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
        return self._reject_if_unservable(req)

    def _on_request_aborted(self, event: ev.RequestAborted) -> Decisions:
        req = self.requests.get(event.req_id)
        if req is None:
            return []  # already finished, or never known: nothing to do
        reason = event.reason if event.reason in ("abort", "stop") else "abort"
        return self._finish(req, reason, [], None, None)

    def _on_step_completed(self, event: ev.StepCompleted) -> Decisions:
        if event.rank != 0:
            return []  # only rank 0 reports sampled tokens
        if not self.in_flight or event.step != self.in_flight[0].step:
            expected = self.in_flight[0].step if self.in_flight else None
            return self._fail(f"StepCompleted for step {event.step}, but the oldest step in flight is {expected}")
        sampled = {token.req_id: token for token in event.sampled}
        failed = {item.req_id: item.message for item in event.failed}
        reports = {report.req_id: report for report in event.prompt_logprobs}
        decisions: Decisions = []
        for item in self.in_flight.popleft().reqs:
            req = self.requests.get(item.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished or aborted while the step ran (steps run ahead never preempt)
            if item.req_id in failed:
                decisions += self._fail_request(req, failed[item.req_id])
                continue
            decisions += self._computed(req, item.num_tokens, reports.get(item.req_id), event.step)
            if not item.samples or req.status != RequestStatus.RUNNING:
                continue  # a prefill chunk that does not reach the end of the prompt, or a bad report
            req.num_pending_samples -= 1
            token = sampled.get(item.req_id)
            if token is None:
                return decisions + self._fail(f"step {event.step}: rank 0 sampled no token for request {item.req_id!r}")
            decisions += self._append_token(req, token)
        return decisions

    def _computed(self, req: Request, num_tokens: int, report: ev.PromptLogprobs | None, step: int) -> Decisions:
        """`num_tokens` more of req's tokens were computed: their full blocks enter the prefix cache,
        and their prompt logprobs not sent before go out (a bad report fails the request)."""
        first, count = prompt_logprobs.step_span(req.num_computed_tokens, num_tokens, req.num_prompt_tokens)
        req.num_in_flight_tokens -= num_tokens
        req.num_computed_tokens += num_tokens
        decisions = prefix.cache_computed(self.scheduler.block_manager, req, self.step)
        error = prompt_logprobs.report_error(req.sampling, first, count, req.num_prompt_logprobs_sent, report)
        if error is not None:
            return decisions + self._fail_request(req, f"step {step}: {error}")
        new = prompt_logprobs.unsent(report, req.num_prompt_logprobs_sent) if report is not None else None
        if new is None:
            return decisions
        req.num_prompt_logprobs_sent = new.start + len(new.logprobs) - 1
        return decisions + [self._emitted(req, [], None, None, None, new)]

    def _on_rank_digest(self, event: ev.RankDigest) -> Decisions:
        tp = self.config.tensor_parallel_size
        if not 0 <= event.rank < tp:
            return self._fail(f"RankDigest from rank {event.rank}, but tensor_parallel_size is {tp}")
        digests = self.rank_digests.setdefault(event.step, {})
        digests[event.rank] = event.digest
        if len(digests) < tp:
            return []
        del self.rank_digests[event.step]
        values = [digests[rank] for rank in range(tp)]
        odd_ranks = [rank for rank in range(tp) if values[rank] != values[0]]
        if not odd_ranks:
            self.last_agreed_step = max(self.last_agreed_step, event.step)
            return []
        listing = ", ".join(f"rank {rank}={values[rank]:#018x}" for rank in range(tp))
        mismatch = ev.DigestMismatch(event.step, values, odd_ranks)
        message = (
            f"tensor-parallel ranks disagree after step {event.step}: ranks {odd_ranks} differ from rank 0 ({listing})"
        )
        return [mismatch] + self._fail(message)

    def _on_worker_failed(self, event: ev.WorkerFailed) -> Decisions:
        return self._fail(f"worker rank {event.rank} failed: {event.message}")

    def _on_adapter_load_requested(self, event: ev.AdapterLoadRequested) -> Decisions:
        return self._evict_unregistered(self.adapters.load(event, self.step))

    def _on_adapter_unload_requested(self, event: ev.AdapterUnloadRequested) -> Decisions:
        return self._evict_unregistered(self.adapters.unload(event))

    def _on_adapter_load_completed(self, event: ev.AdapterLoadCompleted) -> Decisions:
        """Overlapped loading: a slot is ready once every rank reported it. Reference path:
        logged only (a step's plan already waits on the worker side)."""
        return movement.load_completed(self.adapters, event)

    def _on_adapter_load_failed(self, event: ev.AdapterLoadFailed) -> Decisions:
        """Free its slot if it was loading, fail every request of the version, unregister it."""
        version = self.adapters.versions.get(event.version_id)
        if version is None:
            return []  # already dropped (another rank reported it first)
        message = (
            f"adapter {version.name!r} (version {version.version_id}) failed to load on rank {event.rank}: "
            f"{event.message}"
        )
        decisions: Decisions = movement.abort_load(self.adapters, event.version_id)
        for req in sorted(self._live_requests(), key=lambda r: r.arrival_order):
            if req.version_id == event.version_id:
                decisions += self._fail_request(req, message)
        return decisions + self._evict_unregistered(self.adapters.fail(event.version_id))

    def _evict_unregistered(self, decisions: Decisions) -> Decisions:
        """An unregistered adapter version's namespace leaves the prefix cache."""
        if not self.scheduler.is_ready:
            return decisions
        evicted = prefix.evict_namespaces(self.scheduler.block_manager, prefix.unregistered_versions(decisions))
        return prefix.before_reply(decisions, evicted)

    # ------------------------------------------------------------------ request endings

    def _append_token(self, req: Request, token: ev.SampledToken) -> Decisions:
        req.output_token_ids.append(token.token_id)
        reason, stop_token_id = check_stop(
            token.token_id,
            req.num_output_tokens,
            req.num_tokens,
            req.sampling,
            self.eos_token_ids,
            self.config.max_model_len,
        )
        logprobs = [token.logprobs] if token.logprobs is not None else None
        if reason is not None:
            return self._finish(req, reason, [token.token_id], logprobs, stop_token_id)
        return [self._emitted(req, [token.token_id], logprobs, None, None)]

    def _finish(
        self, req: Request, reason: str, token_ids: list[int], logprobs: Any, stop_token_id: int | None
    ) -> Decisions:
        released = self._retire(req, FINISH_REASON_TO_STATUS[reason])
        return [
            self._emitted(req, token_ids, logprobs, reason, stop_token_id),
            ev.RequestFinished(req.req_id, reason, req.num_output_tokens),
        ] + released

    def _fail_request(self, req: Request, message: str) -> Decisions:
        released = self._retire(req, RequestStatus.FINISHED_ERROR)
        return [
            ev.RequestFinished(req.req_id, "error", req.num_output_tokens),
            ev.RequestRejected(req.req_id, f"The worker failed this request: {message}", code=500),
        ] + released

    def _reject_if_unservable(self, req: Request) -> Decisions:
        num_total_blocks = self.scheduler.block_manager.num_total_blocks if self.scheduler.is_ready else None
        message = admission_error(
            req.num_prompt_tokens, req.sampling, self.config.max_model_len, self.config.block_size, num_total_blocks
        )
        if message is None:
            return []
        released = self._retire(req, RequestStatus.FINISHED_ERROR)
        return [ev.RequestRejected(req.req_id, message, code=400)] + released

    def _retire(self, req: Request, status: RequestStatus) -> Decisions:
        """Take a request out for good; returns the adapter decisions its end triggers."""
        released = self.adapters.release(req)
        self.scheduler.remove(req, self.step)
        transition(req, status)
        del self.requests[req.req_id]
        if req.on_worker:
            self.finished_req_ids.append(req.req_id)
        return released

    def _emitted(
        self,
        req: Request,
        token_ids: list[int],
        logprobs: Any,
        reason: str | None,
        stop_token_id: int | None,
        prompt: ev.PromptLogprobs | None = None,
    ) -> ev.TokensEmitted:
        return ev.TokensEmitted(
            req_id=req.req_id,
            new_token_ids=token_ids,
            finish_reason=reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            stop_token_id=stop_token_id,
            prompt_logprobs=prompt,
        )

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
            if self.in_flight or self.adapters.num_loading_slots:
                return []  # planned when a step completes or a load ends
            return self._fail(
                f"the scheduler can make no progress: {len(self.scheduler.waiting)} waiting, nothing fits"
            )
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

    def _live_requests(self) -> list[Request]:
        return list(self.scheduler.waiting) + self.scheduler.running


_HANDLERS = {
    ev.WorkerReady: Core._on_worker_ready,
    ev.RequestArrived: Core._on_request_arrived,
    ev.RequestAborted: Core._on_request_aborted,
    ev.StepCompleted: Core._on_step_completed,
    ev.RankDigest: Core._on_rank_digest,
    ev.WorkerFailed: Core._on_worker_failed,
    ev.AdapterLoadRequested: Core._on_adapter_load_requested,
    ev.AdapterUnloadRequested: Core._on_adapter_unload_requested,
    ev.AdapterLoadCompleted: Core._on_adapter_load_completed,
    ev.AdapterLoadFailed: Core._on_adapter_load_failed,
}
