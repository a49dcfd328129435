"""A minimal scheduler stand-in that drives ModelRunner with NewReq/CachedReq plans:
chunked prefill with a per-request chunk size, decode, preemption, and shared prefix blocks.
It runs in step (`execute` each plan) or one step ahead (`launch` plan N+1 before `complete`
of step N): then a request that samples in step N gets its next decode token scheduled in
N+1 as a placeholder, and the token itself arrives in the following plan's new_token_ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from ledgerserve.shared.events import CachedReq, NewReq, StepCompleted, StepPlan
from ledgerserve.shared.sampling import SamplingParams


@dataclass
class FakeReq:
    req_id: str
    prompt: list[int]
    sampling: SamplingParams
    chunk: int  # max tokens scheduled per step
    lora_slot: int = -1
    outputs: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_scheduled: int = 0
    num_pending: int = 0  # tokens sampled by launched steps, not read back yet
    num_tokens_sent: int = 0  # how many tokens the worker has been told about
    num_blocks_sent: int = 0
    sent: bool = False
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)  # rank 0's reports (PromptLogprobs), one per step

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.outputs


class FakeScheduler:
    def __init__(self, block_size: int, num_blocks: int, plan_past_max_tokens: bool = False) -> None:
        """plan_past_max_tokens: one step ahead, still schedule a request whose pending token is its
        last (as a scheduler must when it stops on an EOS it has not seen yet); its extra token is dropped."""
        self.block_size = block_size
        self.plan_past_max_tokens = plan_past_max_tokens
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.ref_counts: dict[int, int] = {}
        self.running: dict[str, FakeReq] = {}
        self.done: dict[str, FakeReq] = {}
        self.step = 0
        self._finished: list[str] = []
        self._preempted: list[str] = []

    def add(
        self,
        req_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        chunk: int = 4,
        prefix_blocks: list[int] | None = None,
        lora_slot: int = -1,
    ) -> None:
        """prefix_blocks: blocks already holding this prompt's first full blocks (prefix cache)."""
        req = FakeReq(req_id, list(prompt), sampling, chunk, lora_slot)
        if prefix_blocks:
            req.block_ids = list(prefix_blocks)
            for block in prefix_blocks:
                self.ref_counts[block] += 1
            req.num_computed = len(prefix_blocks) * self.block_size
        self.running[req_id] = req

    def preempt(self, req_id: str) -> None:
        """Between steps, in step mode only."""
        req = self.running[req_id]
        self._free(req.block_ids)
        req.block_ids, req.num_computed, req.sent = [], 0, False
        self._preempted.append(req_id)

    def plan(self) -> StepPlan:
        """The next step; each request's computed tokens advance as it is planned, not when it completes."""
        new_reqs, cached_reqs = [], []
        for req in self.running.values():
            req.num_scheduled = self._num_to_schedule(req)
            if req.num_scheduled == 0:
                continue
            self._allocate(req, req.num_computed + req.num_scheduled)
            if not req.sent:
                new_reqs.append(
                    NewReq(
                        req.req_id,
                        req.tokens,
                        len(req.prompt),
                        req.sampling,
                        list(req.block_ids),
                        req.num_computed,
                        req.num_scheduled,
                        req.lora_slot,
                    )
                )
                req.sent = True
            else:
                cached_reqs.append(
                    CachedReq(
                        req.req_id,
                        req.tokens[req.num_tokens_sent :],
                        req.block_ids[req.num_blocks_sent :],
                        req.num_computed,
                        req.num_scheduled,
                        req.lora_slot,
                    )
                )
            req.num_tokens_sent, req.num_blocks_sent = len(req.tokens), len(req.block_ids)
            req.num_computed += req.num_scheduled
            req.num_pending += req.num_computed == len(req.tokens) + req.num_pending  # it samples
        plan = StepPlan(self.step, new_reqs, cached_reqs, self._finished, self._preempted)
        self._finished, self._preempted = [], []
        self.step += 1
        return plan

    def complete(self, completed: StepCompleted) -> None:
        if completed.failed:
            raise AssertionError(f"unexpected failures: {completed.failed}")
        for report in completed.prompt_logprobs:
            self.running[report.req_id].prompt_logprobs.append(report)
        for token in completed.sampled:
            req = self.running.get(token.req_id)
            if req is None:  # run ahead past its last token: dropped
                continue
            req.num_pending -= 1
            req.outputs.append(token.token_id)
            req.logprobs.append(token.logprobs)
            if len(req.outputs) == req.sampling.max_tokens:
                self.done[req.req_id] = self.running.pop(req.req_id)
                self._free(req.block_ids)
                self._finished.append(req.req_id)

    def _num_to_schedule(self, req: FakeReq) -> int:
        """The next chunk; one step ahead, a request whose last sampled token is pending schedules
        that token (a placeholder), and one with two pending tokens waits."""
        if req.num_pending > 1:
            return 0
        if req.num_pending and len(req.outputs) + 1 == req.sampling.max_tokens and not self.plan_past_max_tokens:
            return 0
        return min(req.chunk, len(req.tokens) + req.num_pending - req.num_computed)

    def _allocate(self, req: FakeReq, num_tokens: int) -> None:
        while len(req.block_ids) * self.block_size < num_tokens:
            block = self.free_blocks.pop()
            self.ref_counts[block] = 1
            req.block_ids.append(block)

    def _free(self, block_ids: list[int]) -> None:
        for block in reversed(block_ids):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)


def run_to_completion(runner, sched: FakeScheduler, max_steps: int = 500) -> dict[str, FakeReq]:
    for _ in range(max_steps):
        if not sched.running:
            runner.execute(sched.plan())  # tell the worker about the last finished requests
            return sched.done
        completed, _ = runner.execute(sched.plan())
        sched.complete(completed)
    raise AssertionError("requests did not finish")


def run_one_step_ahead(runner, sched: FakeScheduler, max_steps: int = 500) -> dict[str, FakeReq]:
    """Like run_to_completion, but each plan is launched before the previous step completes."""
    in_flight = None
    for _ in range(max_steps):
        if not sched.running and in_flight is None:
            runner.execute(sched.plan())  # tell the worker about the last finished requests
            return sched.done
        launched = runner.launch(sched.plan()) if sched.running else None
        if in_flight is not None:
            completed, _ = runner.complete(in_flight)
            sched.complete(completed)
        in_flight = launched
    raise AssertionError("requests did not finish")
