"""Turn the scheduler's choice into a StepPlan: new requests in full, running ones as
deltas of what the workers were last sent."""

from __future__ import annotations

from dataclasses import dataclass

from ledgerserve.scheduler_proc.core.request import Request
from ledgerserve.scheduler_proc.core.scheduler import ScheduledReq, distinct
from ledgerserve.shared.events import CachedReq, NewReq, StepPlan


@dataclass(frozen=True)
class InFlightReq:
    req_id: str
    num_tokens: int
    samples: bool  # the scheduled tokens reach the end of the known (and pending) tokens


@dataclass(frozen=True)
class InFlightStep:
    step: int
    reqs: list[InFlightReq]
    lora_slots: list[int]  # the adapter slots the step reads, ascending


def new_req(req: Request, num_tokens: int) -> NewReq:
    return NewReq(
        req_id=req.req_id,
        token_ids=req.token_ids,
        num_prompt_tokens=req.num_prompt_tokens,
        sampling=req.sampling,
        block_ids=list(req.block_ids),
        num_computed_tokens=req.num_planned_tokens,
        num_scheduled_tokens=num_tokens,
        lora_slot=req.lora_slot,
    )


def cached_req(req: Request, num_tokens: int) -> CachedReq:
    return CachedReq(
        req_id=req.req_id,
        new_token_ids=req.token_ids_between(req.num_tokens_on_worker, req.num_tokens),
        new_block_ids=req.block_ids[req.num_blocks_on_worker :],
        num_computed_tokens=req.num_planned_tokens,
        num_scheduled_tokens=num_tokens,
        lora_slot=req.lora_slot,
    )


def build_plan(
    step: int, scheduled: list[ScheduledReq], finished_req_ids: list[str], preempted_req_ids: list[str]
) -> tuple[StepPlan, InFlightStep]:
    """The plan for `step`; records on each request what the workers now hold, and what
    this step puts in flight. A request whose newest token is pending is scheduled past the
    tokens the workers know: they feed it the token they sampled for it in the step before."""
    new_reqs: list[NewReq] = []
    cached_reqs: list[CachedReq] = []
    in_flight: list[InFlightReq] = []
    for item in scheduled:
        req = item.req
        if req.on_worker:
            cached_reqs.append(cached_req(req, item.num_tokens))
        else:
            new_reqs.append(new_req(req, item.num_tokens))
        req.on_worker = True
        req.num_tokens_on_worker = req.num_tokens
        req.num_blocks_on_worker = len(req.block_ids)
        samples = req.num_planned_tokens + item.num_tokens == req.num_tokens + req.num_pending_samples
        req.num_in_flight_tokens += item.num_tokens
        req.num_pending_samples += int(samples)
        in_flight.append(InFlightReq(req.req_id, item.num_tokens, samples))
    plan = StepPlan(
        step=step,
        new_reqs=new_reqs,
        cached_reqs=cached_reqs,
        finished_req_ids=list(finished_req_ids),
        preempted_req_ids=list(preempted_req_ids),
    )
    lora_slots = sorted(distinct([item.req.lora_slot for item in scheduled if item.req.lora_slot >= 0]))
    return plan, InFlightStep(step, in_flight, lora_slots)
