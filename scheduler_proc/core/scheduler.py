"""Continuous batching with chunked prefill: which requests run in the next step, and
how many tokens each computes. Preemption by recompute when KV blocks run out.

Adapters: a step holds at most `max_loras` distinct adapter versions, counting those of
every running request (their slots are pinned), those admitted this step and the user-pinned
versions that hold a slot (they keep it whether the step uses them or not). Waiting
requests go FCFS with adapter affinity: one whose adapter would exceed the cap is skipped
(it keeps its place) and later requests of adapters already in the step, or of the base
model, go ahead. Aging bounds this: once a skipped request has waited
`lora_max_wait_steps` steps since arrival, no adapter request behind it may overtake it, so
the running adapters drain and it gets a slot. Only admitted requests count toward the cap.

With overlapped loading (`slot_ready` given) an adapter request is admitted only once its
version's slot is ready on every rank; one whose version is in no slot, or still loading,
keeps its place and later requests of ready adapters, or of the base model, go ahead. The
same aging bound applies to a request whose version is in no slot: once it has waited
`lora_max_wait_steps`, no adapter request behind it is admitted, the running adapters drain
and the prefetch pass gives it a slot. One whose slot is loading bars nothing (nothing behind
it need drain); a step that leaves such a request waiting counts in `num_lora_wait_steps`.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from ledgerserve.scheduler_proc.core.block_manager import BlockManager, PrefixMatch
from ledgerserve.scheduler_proc.core.config import CoreConfig
from ledgerserve.scheduler_proc.core.finish import reaches_length
from ledgerserve.scheduler_proc.core.request import Request, RequestStatus, transition


@dataclass
class ScheduledReq:
    req: Request
    num_tokens: int  # tokens computed this step, starting at req.num_computed_tokens


class Scheduler:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self._block_manager: BlockManager | None = None  # known once every rank is ready
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: the tail is the newest
        self.num_lora_wait_steps = 0  # planned steps that left a request waiting on its adapter's load

    @property
    def is_ready(self) -> bool:
        return self._block_manager is not None

    @property
    def block_manager(self) -> BlockManager:
        if self._block_manager is None:
            raise RuntimeError("no KV capacity yet: not every worker rank is ready")
        return self._block_manager

    def attach(self, block_manager: BlockManager) -> None:
        if self._block_manager is not None:
            raise RuntimeError("KV capacity is already set")
        self._block_manager = block_manager

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def remove(self, req: Request, step: int) -> None:
        """Take a request out of its queue and free its blocks (finish, abort, reject);
        `step` is the logical step its cached blocks were last used (LRU)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.block_ids:
            self.block_manager.release(req.namespace, req.req_id, req.block_ids, step)
            req.num_shared_blocks = 0

    def schedule(
        self,
        step: int,
        may_preempt: bool = True,
        slot_ready: dict[int, bool] | None = None,
        draining: dict[int, int] | None = None,
        reserved: list[int] | None = None,
    ) -> tuple[list[ScheduledReq], list[Request]]:
        """Running requests first (a decode token or their next prefill chunk), then
        waiting ones FCFS under the adapter cap. `step` is the step being built (aging).
        A step planned ahead of one in flight (`may_preempt` False) stops where blocks run
        out instead of preempting. `slot_ready` (overlapped loading): version -> whether its
        slot is ready (False: loading); absent: in no slot. `draining` (targeted drains, in
        place of the aging bar): a draining slot's version -> the version it drains for.
        `reserved`: versions that hold a slot whether the step uses them or not (user pins);
        they count toward the cap.
        Returns the scheduled requests and the ones preempted."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledReq] = []
        preempted: list[Request] = []
        is_blocked = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_tokens = min(req.num_unplanned_tokens, budget)
            if num_tokens <= 0 or not self._may_run_ahead(req):
                i += 1
                continue
            if not self._make_room(req, num_tokens, preempted, step, may_preempt):
                is_blocked = True  # req preempted itself (the newest running request), or may not preempt
                break
            self.block_manager.grow(req.namespace, req.req_id, req.block_ids, req.num_planned_tokens + num_tokens)
            scheduled.append(ScheduledReq(req, num_tokens))
            budget -= num_tokens
            i += 1
        if _may_admit(scheduled, preempted, is_blocked):
            is_held_by_load = self._admit_waiting(budget, scheduled, step, slot_ready, draining, reserved or [])
            self.num_lora_wait_steps += int(is_held_by_load and bool(scheduled))
        return scheduled, preempted

    def _may_run_ahead(self, req: Request) -> bool:
        """A request whose newest token is still being sampled runs a step ahead only if that
        token cannot be its last by length, and its sampling does not read earlier token ids."""
        if req.num_pending_samples == 0:
            return True
        num_pending = req.num_pending_samples
        return not req.sampling.penalised and not reaches_length(
            req.num_output_tokens + num_pending, req.num_tokens + num_pending, req.sampling, self.config.max_model_len
        )

    def _make_room(self, req: Request, num_tokens: int, preempted: list[Request], step: int, may_preempt: bool) -> bool:
        """Preempt the newest running requests until `req` can grow (free blocks, then
        evictable cached ones, are used first); False if req preempted itself, or if it
        can't grow and `may_preempt` is False."""
        num_needed = req.num_planned_tokens + num_tokens
        while not self.block_manager.can_grow(req.block_ids, num_needed):
            if not may_preempt:
                return False
            victim = self.running[-1]
            self._preempt(victim, step)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request, step: int) -> None:
        self.running.remove(req)
        self.block_manager.release(req.namespace, req.req_id, req.block_ids, step)
        transition(req, RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.forget_in_flight()
        req.num_shared_blocks = 0
        req.on_worker = False
        req.num_preemptions += 1
        transition(req, RequestStatus.WAITING)
        self.waiting.appendleft(req)

    def _admit_waiting(
        self,
        budget: int,
        scheduled: list[ScheduledReq],
        step: int,
        slot_ready: dict[int, bool] | None,
        draining: dict[int, int] | None,
        reserved: list[int],
    ) -> bool:
        """Admit waiting requests FCFS; True if one was left waiting only because its slot loads."""
        version_ids = distinct([req.version_id for req in self.running if req.version_id] + reserved)
        is_barred = False  # an aged, cap-blocked request: no adapter request overtakes it (without drains)
        is_held_by_load = False
        seen_version_ids: list[int] = []  # with drains: the versions of the requests considered so far
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if draining is not None and req.version_id:
                is_drained = draining.get(req.version_id, 0) in seen_version_ids  # behind the drain's request
                if req.version_id not in seen_version_ids:
                    seen_version_ids.append(req.version_id)
                if is_drained:
                    continue
            if req.version_id and slot_ready is not None and not is_barred and slot_ready.get(req.version_id) is False:
                is_held_by_load = True  # its slot loads: it bars nothing
                continue
            if req.version_id and (is_barred or not self._fits(req.version_id, version_ids, slot_ready)):
                is_barred = is_barred or (
                    draining is None and step - req.arrival_step >= self.config.lora_max_wait_steps
                )
                continue
            match = self._match_prefix(req)
            num_tokens = min(req.num_tokens - match.num_cached_tokens, budget)
            if not self.block_manager.can_admit(match, match.num_cached_tokens + num_tokens):
                break  # FCFS: nothing overtakes a request short of blocks
            self._admit(req, match, step)
            self.block_manager.grow(req.namespace, req.req_id, req.block_ids, req.num_computed_tokens + num_tokens)
            transition(req, RequestStatus.RUNNING)
            bisect.insort(self.running, req, key=_arrival_order)
            scheduled.append(ScheduledReq(req, num_tokens))
            budget -= num_tokens
            if req.version_id and req.version_id not in version_ids:
                version_ids.append(req.version_id)
        return is_held_by_load

    def _match_prefix(self, req: Request) -> PrefixMatch:
        """The cached prefix `req` starts from. None for a request asking for prompt logprobs (as in
        vLLM): a cached position has no logits, so every prompt position is computed; its blocks
        still enter the cache as they complete."""
        if req.sampling.prompt_logprobs is not None:
            return PrefixMatch()
        return self.block_manager.match_prefix(req.namespace, req.token_ids)

    def _fits(self, version_id: int, version_ids: list[int], slot_ready: dict[int, bool] | None) -> bool:
        """Whether a request of `version_id` may join the step: its slot is ready (overlapped
        loading), and the step's distinct adapters stay within the cap."""
        if slot_ready is not None and not slot_ready.get(version_id, False):
            return False
        return version_id in version_ids or len(version_ids) < self.config.max_loras

    def _admit(self, req: Request, match: PrefixMatch, step: int) -> None:
        """Take `req` off the waiting queue holding its cached prefix; only the first
        admission sets num_cached_tokens (a resumed request recomputes, not re-prompts)."""
        self.waiting.remove(req)
        self.block_manager.admit(req, match, step)
        if req.num_preemptions == 0:
            req.num_cached_tokens = match.num_cached_tokens


def _may_admit(scheduled: list[ScheduledReq], preempted: list[Request], is_blocked: bool) -> bool:
    """Whether waiting requests may join the step: after a preemption only if no running request
    was scheduled (the preempted ones wait at the head); otherwise unless a running request
    was short of blocks, since nothing overtakes it."""
    return not scheduled if preempted else not is_blocked


def _arrival_order(req: Request) -> int:
    return req.arrival_order


def distinct(ids: list[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        if i not in out:
            out.append(i)
    return out
