"""The core's inputs from the workers: a step's sampled tokens and prompt logprobs (rank 0),
each rank's state digest, and a worker's failure."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ledgerserve.scheduler_proc.core import finish, prefix, prompt_logprobs
from ledgerserve.scheduler_proc.core.decisions import Decisions
from ledgerserve.scheduler_proc.core.request import Request, RequestStatus
from ledgerserve.shared import events as ev

if TYPE_CHECKING:
    from ledgerserve.scheduler_proc.core.core import Core


def on_step_completed(core: Core, event: ev.StepCompleted) -> Decisions:
    if event.rank != 0:
        return []  # only rank 0 reports sampled tokens
    if not core.in_flight or event.step != core.in_flight[0].step:
        expected = core.in_flight[0].step if core.in_flight else None
        return core.fail(f"StepCompleted for step {event.step}, but the oldest step in flight is {expected}")
    sampled = {token.req_id: token for token in event.sampled}
    failed = {item.req_id: item.message for item in event.failed}
    reports = {report.req_id: report for report in event.prompt_logprobs}
    decisions: Decisions = []
    for item in core.in_flight.popleft().reqs:
        req = core.requests.get(item.req_id)
        if req is None or req.status != RequestStatus.RUNNING:
            continue  # finished or aborted while the step ran (steps run ahead never preempt)
        if item.req_id in failed:
            decisions += finish.fail_request(core, req, failed[item.req_id])
            continue
        decisions += _computed(core, req, item.num_tokens, reports.get(item.req_id), event.step)
        if not item.samples or req.status != RequestStatus.RUNNING:
            continue  # a prefill chunk that does not reach the end of the prompt, or a bad report
        req.num_pending_samples -= 1
        token = sampled.get(item.req_id)
        if token is None:
            return decisions + core.fail(f"step {event.step}: rank 0 sampled no token for request {item.req_id!r}")
        decisions += finish.append_token(core, req, token)
    return decisions


def _computed(core: Core, req: Request, num_tokens: int, report: ev.PromptLogprobs | None, step: int) -> Decisions:
    """`num_tokens` more of req's tokens were computed: their full blocks enter the prefix cache,
    and their prompt logprobs not sent before go out (a bad report fails the request)."""
    first, count = prompt_logprobs.step_span(req.num_computed_tokens, num_tokens, req.num_prompt_tokens)
    req.num_in_flight_tokens -= num_tokens
    req.num_computed_tokens += num_tokens
    decisions = prefix.cache_computed(core.scheduler.block_manager, req, core.step)
    error = prompt_logprobs.report_error(req.sampling, first, count, req.num_prompt_logprobs_sent, report)
    if error is not None:
        return decisions + finish.fail_request(core, req, f"step {step}: {error}")
    new = prompt_logprobs.unsent(report, req.num_prompt_logprobs_sent) if report is not None else None
    if new is None:
        return decisions
    req.num_prompt_logprobs_sent = new.start + len(new.logprobs) - 1
    return decisions + [finish.emitted(req, [], None, None, None, new)]


def on_rank_digest(core: Core, event: ev.RankDigest) -> Decisions:
    tp = core.config.tensor_parallel_size
    if not 0 <= event.rank < tp:
        return core.fail(f"RankDigest from rank {event.rank}, but tensor_parallel_size is {tp}")
    digests = core.rank_digests.setdefault(event.step, {})
    digests[event.rank] = event.digest
    if len(digests) < tp:
        return []
    del core.rank_digests[event.step]
    values = [digests[rank] for rank in range(tp)]
    odd_ranks = [rank for rank in range(tp) if values[rank] != values[0]]
    if not odd_ranks:
        core.last_agreed_step = max(core.last_agreed_step, event.step)
        return []
    listing = ", ".join(f"rank {rank}={values[rank]:#018x}" for rank in range(tp))
    mismatch = ev.DigestMismatch(event.step, values, odd_ranks)
    message = (
        f"tensor-parallel ranks disagree after step {event.step}: ranks {odd_ranks} differ from rank 0 ({listing})"
    )
    return [mismatch] + core.fail(message)


def on_worker_failed(core: Core, event: ev.WorkerFailed) -> Decisions:
    return core.fail(f"worker rank {event.rank} failed: {event.message}")
