"""The worker's side of the serving-path profile (shared/spans.py): one WorkerStep per step, with
when the device ran it. On CUDA a timing event is recorded on the compute stream before and after
each step's work, and read once the step is done (reading a finished event never waits); its time
is placed on the host's monotonic clock through one reference event recorded with the device idle.
On the CPU the forward pass runs inside the launch, so the launch is the device's time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ledgerserve.shared import spans
from ledgerserve.shared.events import StepPlan


@dataclass
class _OpenStep:
    recv_ns: int
    begin_ns: int
    launched_ns: int
    start: torch.cuda.Event | None
    end: torch.cuda.Event | None
    num_reqs: int
    num_prefill_tokens: int
    num_decode_tokens: int


def token_counts(plan: StepPlan) -> tuple[int, int]:
    """(prefill, decode) tokens of a plan: a request new to the rank or scheduled for more than one
    token is prefilling; one token of a request the rank holds is a decode (so is a one-token last
    chunk of a prompt: the plan does not tell them apart)."""
    num_prefill = sum(r.num_scheduled_tokens for r in plan.new_reqs)
    num_prefill += sum(r.num_scheduled_tokens for r in plan.cached_reqs if r.num_scheduled_tokens > 1)
    num_decode = sum(1 for r in plan.cached_reqs if r.num_scheduled_tokens == 1)
    return num_prefill, num_decode


class StepProfiler:
    def __init__(self, writer: spans.SpanWriter, rank: int, device: torch.device) -> None:
        self.writer, self.rank = writer, rank
        self.cuda = device.type == "cuda"
        self.open: dict[int, _OpenStep] = {}
        self.ref: torch.cuda.Event | None = None
        self.ref_ns = 0

    def begin(self, plan: StepPlan, recv_ns: int) -> None:
        """Before the step's work is queued."""
        start = self._event() if self.cuda else None
        num_prefill, num_decode = token_counts(plan)
        num_reqs = len(plan.new_reqs) + len(plan.cached_reqs)
        now = spans.now_ns()
        self.open[plan.step] = _OpenStep(recv_ns, now, now, start, None, num_reqs, num_prefill, num_decode)

    def launched(self, step: int) -> None:
        """After the step's work is queued (on the CPU: done)."""
        item = self.open.get(step)
        if item is not None:
            item.end = self._event() if self.cuda else None
            item.launched_ns = spans.now_ns()

    def sending(self, step: int, done_ns: int) -> None:
        """The step's replies are about to go; `done_ns`: when its tokens were read back."""
        item = self.open.pop(step, None)
        if item is None:
            return
        gpu_start_ns, gpu_end_ns = item.begin_ns, item.launched_ns
        if item.start is not None and item.end is not None:
            gpu_start_ns, gpu_end_ns = self._host_ns(item.start), self._host_ns(item.end)
        self.writer.add(
            spans.WorkerStep(
                self.rank,
                step,
                item.recv_ns,
                item.launched_ns,
                gpu_start_ns,
                gpu_end_ns,
                done_ns,
                spans.now_ns(),
                item.num_reqs,
                item.num_prefill_tokens,
                item.num_decode_tokens,
            )
        )

    def close(self) -> None:
        self.writer.close()

    def _event(self) -> torch.cuda.Event:
        if self.ref is None:  # the reference: recorded with the device idle, so its host time is known
            torch.cuda.synchronize()
            self.ref = torch.cuda.Event(enable_timing=True)
            self.ref.record()
            self.ref.synchronize()
            self.ref_ns = spans.now_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _host_ns(self, event: torch.cuda.Event) -> int:
        assert self.ref is not None
        return self.ref_ns + int(self.ref.elapsed_time(event) * 1e6)
