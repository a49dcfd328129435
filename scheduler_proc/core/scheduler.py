"""Continuous batching with chunked prefill: which requests run in the next step, and
how many tokens each computes. Preemption by recompute when KV blocks run out."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from scheduler_proc.core.block_manager import BlockManager
from scheduler_proc.core.config import CoreConfig
from scheduler_proc.core.request import Request, RequestStatus, transition


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

    def remove(self, req: Request) -> None:
        """Take a request out of its queue and free its blocks (finish, abort, reject)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        if req.block_ids:
            self.block_manager.release(req.namespace, req.req_id, req.block_ids)

    def schedule(self) -> tuple[list[ScheduledReq], list[Request]]:
        """Running requests first (a decode token or their next prefill chunk), then
        waiting ones FCFS. Returns the scheduled requests and the ones preempted."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledReq] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_tokens = min(req.num_uncomputed_tokens, budget)
            if num_tokens <= 0:
                i += 1
                continue
            if not self._make_room(req, num_tokens, preempted):
                break  # req preempted itself: it was the newest running request
            self.block_manager.grow(req.namespace, req.req_id, req.block_ids, req.num_computed_tokens + num_tokens)
            scheduled.append(ScheduledReq(req, num_tokens))
            budget -= num_tokens
            i += 1
        if not preempted or not scheduled:
            self._admit_waiting(budget, scheduled)
        return scheduled, preempted

    def _make_room(self, req: Request, num_tokens: int, preempted: list[Request]) -> bool:
        """Preempt the newest running requests until `req` can grow; False if that was req."""
        num_needed = req.num_computed_tokens + num_tokens
        while not self.block_manager.can_grow(req.block_ids, num_needed):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.release(req.namespace, req.req_id, req.block_ids)
        transition(req, RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.on_worker = False
        req.num_preemptions += 1
        transition(req, RequestStatus.WAITING)
        self.waiting.appendleft(req)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledReq]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not req.block_ids:
                self._match_prefix(req)
            num_tokens = min(req.num_uncomputed_tokens, budget)
            if not self.block_manager.can_grow(req.block_ids, req.num_computed_tokens + num_tokens):
                break  # FCFS: nothing overtakes the head of the queue
            self.waiting.popleft()
            self.block_manager.grow(req.namespace, req.req_id, req.block_ids, req.num_computed_tokens + num_tokens)
            transition(req, RequestStatus.RUNNING)
            bisect.insort(self.running, req, key=_arrival_order)
            scheduled.append(ScheduledReq(req, num_tokens))
            budget -= num_tokens

    def _match_prefix(self, req: Request) -> None:
        match = self.block_manager.match_prefix(req.namespace, req.token_ids)
        req.block_ids = list(match.block_ids)
        req.num_computed_tokens = match.num_cached_tokens
        req.num_cached_tokens = match.num_cached_tokens


def _arrival_order(req: Request) -> int:
    return req.arrival_order
