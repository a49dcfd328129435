"""The worker's serve loop over fake sockets: replies in command order, a plan that arrives
while a step is in flight launched before that step is read back, the in-flight step
completed before any other command, faults while completing reported; and a real runner
served by a scheduler one step ahead gives the synchronous tokens."""

from __future__ import annotations

import logging

import torch

from ledgerserve.shared import codec, events
from ledgerserve.worker_proc.main import serve
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner
from ledgerserve.worker_proc.sampler import HostCopy, PendingSample
from tests.worker_proc.fake_scheduler import FakeScheduler, run_to_completion
from tests.worker_proc.test_async_runner import REQS, results
from tests.worker_proc.test_runner import tiny_config

LOG = logging.getLogger("test-serve")


class Outbox:
    """The worker's outbound socket: decodes and records what it sends."""

    def __init__(self, trace: list[str]) -> None:
        self.trace = trace
        self.sent: list[events.Event] = []
        self.decoder = codec.from_worker_decoder()

    def send(self, frame: bytes) -> None:
        ev = self.decoder.decode(frame)
        self.sent.append(ev)
        self.trace.append(f"send {_describe(ev)}")


class ScriptedInbox:
    """The worker's inbound socket: each frame becomes available once the worker has sent
    `after` replies, so a script plays a scheduler in step (a plan after the last reply) or
    ahead (a plan before it). A recv with nothing available would block forever: it fails."""

    def __init__(self, outbox: Outbox, script: list[tuple[int, events.Event | bytes]]) -> None:
        self.outbox, self.script = outbox, list(script)

    def _ready(self) -> bool:
        return bool(self.script) and len(self.outbox.sent) >= self.script[0][0]

    def poll(self, timeout: int = 0) -> bool:
        assert timeout == 0
        return self._ready()

    def recv(self) -> bytes:
        assert self._ready(), "the worker would block forever"
        _, cmd = self.script.pop(0)
        if isinstance(cmd, bytes):
            self.outbox.trace.append("recv garbage")
            return cmd
        self.outbox.trace.append(f"recv {_describe(cmd)}")
        return codec.encode(cmd)


class BusyDevice:
    """Stands in for the CUDA event after a step's copy to the host: reads as running for `num_queries` queries."""

    def __init__(self, num_queries: int) -> None:
        self.num_queries = num_queries

    def query(self) -> bool:
        self.num_queries -= 1
        return self.num_queries < 0


class LateInbox(ScriptedInbox):
    """A ScriptedInbox whose every frame shows up `num_polls` polls after it is due: the
    scheduler's time to plan, while the device still runs the step."""

    def __init__(self, outbox: Outbox, script: list, num_polls: int) -> None:
        super().__init__(outbox, script)
        self.num_polls, self.num_waited = num_polls, 0

    def poll(self, timeout: int = 0) -> bool:
        if super()._ready() and self.num_waited < self.num_polls:
            self.num_waited += 1
            return False
        return super().poll(timeout)

    def recv(self) -> bytes:
        self.num_waited = 0
        return super().recv()


class TraceRunner:
    """A runner that records what serve asks of it; step N samples token N for request 'r'."""

    def __init__(
        self, trace: list[str], rank: int = 0, fail_complete_at: int | None = None, num_busy_queries: int = 0
    ) -> None:
        self.trace, self.rank, self.fail_complete_at = trace, rank, fail_complete_at
        self.num_busy_queries = num_busy_queries  # each step reads as running this many times

    def launch(self, plan: events.StepPlan) -> InFlightStep:
        self.trace.append(f"launch {plan.step}")
        digest = events.RankDigest(plan.step, self.rank, 1000 + plan.step)
        host = HostCopy((), BusyDevice(self.num_busy_queries))  # type: ignore[arg-type]
        return InFlightStep(plan.step, ["r"], PendingSample(torch.zeros(1, dtype=torch.long), host, []), [], digest)

    def complete(self, step: InFlightStep) -> tuple[events.StepCompleted, events.RankDigest]:
        self.trace.append(f"complete {step.step}")
        if step.step == self.fail_complete_at:
            raise RuntimeError("device fault")
        sampled = [events.SampledToken("r", step.step)] if self.rank == 0 else []
        return events.StepCompleted(step.step, self.rank, sampled), step.digest

    @property
    def adapters(self) -> TraceRunner:
        return self

    def command(self, cmd: events.Event, arrival_s: float) -> list[events.Event]:
        if isinstance(cmd, events.AdapterSlotAssigned):
            self.trace.append(f"load {cmd.slot}")
            return [events.AdapterLoadCompleted(self.rank, cmd.slot, cmd.version_id)]
        assert isinstance(cmd, events.AdapterEvicted)
        self.trace.append(f"evict {cmd.slot}")
        return []

    def poll(self) -> list[events.Event]:
        return []

    def busy(self) -> bool:
        return False


def _describe(ev: events.Event) -> str:
    step = getattr(ev, "step", getattr(ev, "slot", ""))
    return f"{type(ev).__name__} {step}".strip()


def _serve(
    script: list[tuple[int, events.Event | bytes]], rank: int = 0, fail_complete_at: int | None = None
) -> tuple[int, list[str], Outbox]:
    trace: list[str] = []
    outbox = Outbox(trace)
    runner = TraceRunner(trace, rank, fail_complete_at)
    code = serve(runner, rank, ScriptedInbox(outbox, script), outbox, LOG)  # type: ignore[arg-type]
    return code, trace, outbox


def _plan(step: int) -> events.StepPlan:
    return events.StepPlan(step)


def _replies(step: int) -> list[str]:
    return [f"complete {step}", f"send StepCompleted {step}", f"send RankDigest {step}"]


def test_a_scheduler_in_step_gets_each_step_read_back_at_once() -> None:
    script = [(0, _plan(0)), (2, _plan(1)), (4, events.Shutdown("done"))]
    code, trace, _ = _serve(script)
    assert code == 0
    assert trace == [
        "recv StepPlan 0",
        "launch 0",
        *_replies(0),
        "recv StepPlan 1",
        "launch 1",
        *_replies(1),
        "recv Shutdown",
    ]


def test_a_plan_waiting_is_launched_before_the_step_in_flight_is_read_back() -> None:
    # one step ahead: plan N+1 follows StepCompleted N-1 (two replies per step on rank 0)
    script = [(0, _plan(0)), (0, _plan(1)), (2, _plan(2)), (4, _plan(3)), (8, events.Shutdown())]
    code, trace, outbox = _serve(script)
    assert code == 0
    assert trace == [
        "recv StepPlan 0",
        "launch 0",
        "recv StepPlan 1",
        "launch 1",
        *_replies(0),
        "recv StepPlan 2",
        "launch 2",
        *_replies(1),
        "recv StepPlan 3",
        "launch 3",
        *_replies(2),
        *_replies(3),  # nothing waiting: read back rather than block
        "recv Shutdown",
    ]
    assert [ev.sampled[0].token_id for ev in outbox.sent if isinstance(ev, events.StepCompleted)] == [0, 1, 2, 3]


def test_a_plan_that_arrives_while_the_device_runs_is_launched_behind_the_step() -> None:
    """The worker spins on the socket and the device: plan N+1 arriving before step N ends is
    launched first, so the device never waits for the host; once a step ends with nothing
    waiting, it is read back."""
    script = [(0, _plan(0)), (0, _plan(1)), (2, _plan(2)), (6, events.Shutdown())]
    trace: list[str] = []
    outbox = Outbox(trace)
    runner = TraceRunner(trace, num_busy_queries=5)
    assert serve(runner, 0, LateInbox(outbox, script, num_polls=2), outbox, LOG) == 0  # type: ignore[arg-type]
    assert trace == [
        "recv StepPlan 0",
        "launch 0",
        "recv StepPlan 1",
        "launch 1",
        *_replies(0),
        "recv StepPlan 2",
        "launch 2",
        *_replies(1),
        *_replies(2),  # step 2 ended with nothing waiting
        "recv Shutdown",
    ]


def test_other_commands_wait_for_the_step_in_flight() -> None:
    script = [
        (0, _plan(0)),
        (0, events.AdapterSlotAssigned(3, 7, "/a")),
        (0, b"garbage"),
        (0, events.AdapterEvicted(3, 7)),
        (0, _plan(1)),
        (0, events.Shutdown()),
    ]
    code, trace, _ = _serve(script)
    assert code == 0
    assert trace == [
        "recv StepPlan 0",
        "launch 0",
        "recv AdapterSlotAssigned 3",
        *_replies(0),
        "load 3",
        "send AdapterLoadCompleted 3",
        "recv garbage",
        "recv AdapterEvicted 3",
        "evict 3",
        "recv StepPlan 1",
        "launch 1",
        "recv Shutdown",
        *_replies(1),
    ]


def test_other_ranks_send_only_digests() -> None:
    code, trace, outbox = _serve([(0, _plan(0)), (0, _plan(1)), (1, events.Shutdown())], rank=1)
    assert code == 0
    assert [type(ev).__name__ for ev in outbox.sent] == ["RankDigest", "RankDigest"]
    assert trace.index("launch 1") < trace.index("send RankDigest 0")


def test_a_fault_while_reading_a_step_back_fails_the_worker() -> None:
    code, trace, outbox = _serve([(0, _plan(0)), (0, _plan(1)), (0, _plan(2))], fail_complete_at=1)
    assert code == 1
    assert trace[-2:] == ["complete 1", "send WorkerFailed"]
    assert outbox.sent[-1] == events.WorkerFailed(0, "step 1 failed: device fault")


def test_a_step_still_running_past_the_collective_timeout_fails_the_worker() -> None:
    """With tensor parallelism a step the device never finishes (a rank stalled in a collective the
    host cannot time out) is reported, naming the step, once it ran `stall_s`; the steps before it
    complete as usual."""
    trace: list[str] = []
    outbox = Outbox(trace)
    script = [(0, _plan(0)), (2, _plan(1)), (4, events.Shutdown("done"))]
    code = serve(StallingRunner(trace), 0, ScriptedInbox(outbox, script), outbox, LOG, stall_s=0.05)  # type: ignore[arg-type]
    assert code == 1
    assert trace[-2:] == ["launch 1", "send WorkerFailed"] and _replies(0)[0] in trace
    message = "step 1 failed: still running 0.05 s after its launch (tensor-parallel collective timeout)"
    assert outbox.sent[-1] == events.WorkerFailed(0, message)


class StallingRunner(TraceRunner):
    """Step 1 never finishes on the device; the others do at once."""

    def launch(self, plan: events.StepPlan) -> InFlightStep:
        self.num_busy_queries = 10**9 if plan.step == 1 else 0
        return super().launch(plan)


class AheadScheduler:
    """A FakeScheduler one step ahead behind both fake sockets: it sends plan N+1 once it has
    StepCompleted N-1 (two steps unanswered at most), then the last finished ids, then Shutdown."""

    def __init__(self, sched: FakeScheduler) -> None:
        self.sched = sched
        self.decoder = codec.from_worker_decoder()
        self.num_unanswered = 0
        self.max_unanswered = 0
        self.final_sent = False

    def _ready(self) -> bool:
        return self.num_unanswered < (2 if self.sched.running else 1)

    def poll(self, timeout: int = 0) -> bool:
        return self._ready()

    def recv(self) -> bytes:
        assert self._ready(), "the worker would block forever"
        if not self.sched.running and self.final_sent:
            return codec.encode(events.Shutdown())
        self.final_sent = not self.sched.running
        self.num_unanswered += 1
        self.max_unanswered = max(self.max_unanswered, self.num_unanswered)
        return codec.encode(self.sched.plan())

    def send(self, frame: bytes) -> None:
        ev = self.decoder.decode(frame)
        assert not isinstance(ev, events.WorkerFailed), ev
        if isinstance(ev, events.StepCompleted):
            self.sched.complete(ev)
            self.num_unanswered -= 1


def test_a_runner_served_one_step_ahead_gives_the_sync_tokens(tiny_checkpoint: str) -> None:
    def sched() -> FakeScheduler:
        s = FakeScheduler(4, 64)
        for i, (name, (prompt_len, chunk, params)) in enumerate(REQS.items()):
            s.add(name, list(range(3 + i, 3 + i + prompt_len)), params, chunk=chunk)
        return s

    sync = run_to_completion(ModelRunner(tiny_config(tiny_checkpoint)), sched())
    ahead = AheadScheduler(sched())
    runner = ModelRunner(tiny_config(tiny_checkpoint))
    assert serve(runner, 0, ahead, ahead, LOG) == 0  # type: ignore[arg-type]
    assert ahead.max_unanswered == 2 and runner.requests.reqs == {}
    assert results(ahead.sched.done) == results(sync)
