"""The serving-path profile's figures, from each process's spans (shared/spans.py) and the event
log: pure functions, no server. A window is one pass of one workload, [start_ns, end_ns) on the
monotonic clock the spans use.

Per step (rank 0): the device's busy and idle time; each process's host time on the step; the IPC
latencies between processes; the event log's write and fsync time; prefill and decode tokens.
`step_chains` breaks each step's cycle (one step's device end to the next's) into the hops that
produced it: read back, reply, IPC up, the scheduler, IPC down, the launch, the device. With one
step in flight (no async scheduling) those hops are the whole cycle, and they add up to it.

Per request: where its time to first token went (`ttft_parts`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ledgerserve.shared import events, spans
from scripts.serving.serving_report import percentile

MS = 1e6  # ns per ms


@dataclass
class Spans:
    steps: list[spans.WorkerStep]  # rank 0, by step
    inputs: list[spans.SchedulerInput]  # in seq order
    outputs: list[spans.HttpOutput]
    requests: list[spans.HttpRequest]
    syncs: list[spans.LogSync]  # group-commit fsyncs, in order

    @staticmethod
    def of(records: Iterable[spans.Span]) -> Spans:
        records = list(records)
        steps = sorted((r for r in records if isinstance(r, spans.WorkerStep) and r.rank == 0), key=lambda r: r.step)
        inputs = sorted((r for r in records if isinstance(r, spans.SchedulerInput)), key=lambda r: r.seq)
        outputs = sorted((r for r in records if isinstance(r, spans.HttpOutput)), key=lambda r: r.recv_ns)
        requests = [r for r in records if isinstance(r, spans.HttpRequest)]
        syncs = sorted((r for r in records if isinstance(r, spans.LogSync)), key=lambda r: r.start_ns)
        return Spans(steps, inputs, outputs, requests, syncs)


@dataclass
class LogFacts:
    """What the profile reads of the event log: each request's arrival record and first steps."""

    arrival_seq: dict[str, int]  # req_id -> seq of its RequestArrived
    first_step: dict[str, int]  # req_id -> the first step that computed it
    first_token_step: dict[str, int]  # req_id -> the step that sampled its first token

    @staticmethod
    def of(records: Iterable[tuple[int, Any]]) -> LogFacts:
        facts = LogFacts({}, {}, {})
        for seq, event in records:
            if isinstance(event, events.RequestArrived):
                facts.arrival_seq.setdefault(event.req_id, seq)
            elif isinstance(event, events.StepPlan):
                for req in event.new_reqs:
                    facts.first_step.setdefault(req.req_id, event.step)
            elif isinstance(event, events.StepCompleted) and event.rank == 0:
                for token in event.sampled:
                    facts.first_token_step.setdefault(token.req_id, event.step)
        return facts


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, p50, p90 and p99 (serving_report's interpolation), rounded to µs of ms."""
    mean = sum(values) / len(values) if values else None
    figures = {"mean": mean, **{f"p{q}": percentile(values, q) for q in (50, 90, 99)}}
    return {k: None if v is None else round(v, 3) for k, v in figures.items()}


def in_window(steps: Sequence[spans.WorkerStep], start_ns: int, end_ns: int) -> list[spans.WorkerStep]:
    return [s for s in steps if start_ns <= s.gpu_start_ns < end_ns]


def device_time(steps: Sequence[spans.WorkerStep]) -> dict[str, Any]:
    """The device's busy and idle time over the steps' span (first start to last end)."""
    if not steps:
        return {"num_steps": 0}
    span_ns = steps[-1].gpu_end_ns - steps[0].gpu_start_ns
    busy_ns = sum(s.gpu_end_ns - s.gpu_start_ns for s in steps)
    cycles = [(b.gpu_end_ns - a.gpu_end_ns) / MS for a, b in zip(steps, steps[1:])]
    return {
        "num_steps": len(steps),
        "span_ms": round(span_ns / MS, 3),
        "busy_ms": round(busy_ns / MS, 3),
        "idle_share": round(1 - busy_ns / span_ns, 4) if span_ns > 0 else None,
        "cycle_ms": percentiles(cycles),
        "busy_ms_per_step": percentiles([(s.gpu_end_ns - s.gpu_start_ns) / MS for s in steps]),
        "prefill_tokens_per_step": percentiles([s.num_prefill_tokens for s in steps]),
        "decode_tokens_per_step": percentiles([s.num_decode_tokens for s in steps]),
        "num_steps_with_prefill": sum(1 for s in steps if s.num_prefill_tokens),
        # how long before the device finished a step the next one's plan reached the worker (< 0: it waited)
        "plan_lead_ms": percentiles([(a.gpu_end_ns - b.recv_ns) / MS for a, b in zip(steps, steps[1:])]),
        "num_plans_late": sum(1 for a, b in zip(steps, steps[1:]) if b.recv_ns > a.gpu_end_ns),
        "idle_ms_per_gap": percentiles([max(0, b.gpu_start_ns - a.gpu_end_ns) / MS for a, b in zip(steps, steps[1:])]),
    }


def host_time(sp: Spans, steps: Sequence[spans.WorkerStep], start_ns: int, end_ns: int) -> dict[str, Any]:
    """Host time per step of each process's instrumented work, and the log's write and fsync time."""
    inputs = [i for i in sp.inputs if start_ns <= i.recv_ns < end_ns]
    outputs = [o for o in sp.outputs if start_ns <= o.recv_ns < end_ns]
    num_steps = max(1, len(steps))
    fsyncs = [(i.synced_ns - i.applied_ns) / MS for i in inputs if i.fsynced]  # inline (--event-log-fsync always)
    fsyncs += [(s.end_ns - s.start_ns) / MS for s in sp.syncs if start_ns <= s.start_ns < end_ns]  # group commit
    return {
        "worker_launch_ms": percentiles([(s.launched_ns - s.recv_ns) / MS for s in steps]),
        "worker_reply_ms": percentiles([(s.sent_ns - s.done_ns) / MS for s in steps]),
        "scheduler_ms_per_step": round(sum(i.end_ns - i.recv_ns for i in inputs) / MS / num_steps, 3),
        "scheduler_apply_ms_per_step": round(sum(i.applied_ns - i.recv_ns for i in inputs) / MS / num_steps, 3),
        "scheduler_commit_ms_per_step": round(sum(i.synced_ns - i.applied_ns for i in inputs) / MS / num_steps, 3),
        "scheduler_send_ms_per_step": round(sum(i.sent_ns - i.synced_ns for i in inputs) / MS / num_steps, 3),
        "scheduler_views_ms_per_step": round(sum(i.end_ns - i.sent_ns for i in inputs) / MS / num_steps, 3),
        "num_scheduler_inputs": len(inputs),
        "fsync_ms": percentiles(fsyncs),
        "num_fsyncs": len(fsyncs),
        "http_dispatch_ms_per_step": round(sum(o.handled_ns - o.recv_ns for o in outputs) / MS / num_steps, 3),
        "http_frames_per_wake": percentiles([o.num_frames for o in outputs]),
    }


def planner_of(sp: Spans) -> dict[int, spans.SchedulerInput]:
    """step -> the scheduler input whose decisions planned it."""
    return {i.planned_step: i for i in sp.inputs if i.planned_step}


def completion_of(sp: Spans) -> dict[int, spans.SchedulerInput]:
    """step -> the scheduler input of its StepCompleted."""
    return {i.step: i for i in sp.inputs if i.kind == "StepCompleted"}


def ipc_latency(sp: Spans, steps: Sequence[spans.WorkerStep]) -> dict[str, Any]:
    """Scheduler -> worker (a plan's send to its receipt), worker -> scheduler (a StepCompleted's)."""
    planner, completion = planner_of(sp), completion_of(sp)
    down = [(s.recv_ns - planner[s.step].plan_sent_ns) / MS for s in steps if s.step in planner]
    up = [(completion[s.step].recv_ns - s.sent_ns) / MS for s in steps if s.step in completion]
    return {"scheduler_to_worker_ms": percentiles(down), "worker_to_scheduler_ms": percentiles(up)}


CHAIN_HOPS = ("read_back", "reply", "ipc_up", "scheduler", "ipc_down", "launch", "device")


def step_chains(sp: Spans, steps: Sequence[spans.WorkerStep]) -> list[dict[str, float]]:
    """For each step planned on the previous step's StepCompleted: its cycle (previous device end to
    its device end) and the hops along the way, in ms. Steps planned on another input are left out."""
    planner = planner_of(sp)
    chains = []
    for prev, step in zip(steps, steps[1:]):
        via = planner.get(step.step)
        if via is None or via.kind != "StepCompleted" or via.step != prev.step:
            continue
        marks = (prev.gpu_end_ns, prev.done_ns, prev.sent_ns, via.recv_ns, via.plan_sent_ns, step.recv_ns)
        marks += (step.gpu_start_ns, step.gpu_end_ns)
        hops = {name: (b - a) / MS for name, a, b in zip(CHAIN_HOPS, marks, marks[1:])}
        chains.append({"step": step.step, "cycle": (step.gpu_end_ns - prev.gpu_end_ns) / MS, **hops})
    return chains


def chain_summary(chains: Sequence[dict[str, float]]) -> dict[str, Any]:
    return {"num_steps": len(chains), **{hop: percentiles([c[hop] for c in chains]) for hop in ("cycle", *CHAIN_HOPS)}}


TTFT_PARTS = ("http_in", "to_scheduler", "waiting", "prefill", "emit", "http_out")


def ttft_parts(sp: Spans, facts: LogFacts, start_ns: int, end_ns: int) -> list[dict[str, float]]:
    """Per request received in the window: its server-side time to first token and the parts that
    add up to it: the HTTP process before the hand-off, IPC to the scheduler, waiting (queue and
    scheduling, to the send of its first step's plan), prefill (to the worker's reply of the step
    that sampled its first token), emit (the scheduler, until that step's outputs may go), and
    the HTTP process after (IPC, detokenizing, the chunk handed to the response)."""
    by_seq = {i.seq: i for i in sp.inputs}
    planner, completion = planner_of(sp), completion_of(sp)
    steps = {s.step: s for s in sp.steps}
    rows = []
    for req in sp.requests:
        if not start_ns <= req.received_ns < end_ns or not req.first_chunk_ns:
            continue
        arrived = by_seq.get(facts.arrival_seq.get(req.req_id, -1))
        plan = planner.get(facts.first_step.get(req.req_id, -1))
        token_step = facts.first_token_step.get(req.req_id, -1)
        worker, done = steps.get(token_step), completion.get(token_step)
        if arrived is None or plan is None or worker is None or done is None:
            continue
        marks = (req.received_ns, req.submitted_ns, arrived.recv_ns, plan.plan_sent_ns, worker.sent_ns, done.synced_ns)
        marks += (req.first_chunk_ns,)
        row = {name: (b - a) / MS for name, a, b in zip(TTFT_PARTS, marks, marks[1:])}
        rows.append({"ttft": (req.first_chunk_ns - req.received_ns) / MS, **row})
    return rows


def ttft_summary(rows: Sequence[dict[str, float]]) -> dict[str, Any]:
    return {"num_requests": len(rows), **{k: percentiles([r[k] for r in rows]) for k in ("ttft", *TTFT_PARTS)}}


def window_report(sp: Spans, facts: LogFacts, start_ns: int, end_ns: int) -> dict[str, Any]:
    steps = in_window(sp.steps, start_ns, end_ns)
    return {
        "device": device_time(steps),
        "host": host_time(sp, steps, start_ns, end_ns),
        "ipc": ipc_latency(sp, steps),
        "step_chain": chain_summary(step_chains(sp, steps)),
        "ttft_parts_ms": ttft_summary(ttft_parts(sp, facts, start_ns, end_ns)),
    }
