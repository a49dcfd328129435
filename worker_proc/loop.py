"""The worker's command loop: one class, `WorkerLoop`, that applies the scheduler's commands in
order and sends their replies (worker_proc/main.py starts the process and runs it)."""

from __future__ import annotations

import enum
import logging
import time

import msgspec
import zmq

from ledgerserve.shared import codec, env, events, spans
from ledgerserve.worker_proc.parallel import CollectiveFailed
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner
from ledgerserve.worker_proc.step_profile import StepProfiler

PEER_GONE_GRACE_S = 5.0  # how long a rank whose collective lost a peer waits for the launcher
STALL_S = 3600.0  # test-only fault: how long a stalled rank sleeps (the engine stops it long before)
# While a step runs and adapter loads are under way, each turn of the spin sleeps this long
# (0.17 ms with the timer's slack on Linux, against 1.1 ms for a 1 ms zmq poll): that much may be
# added to noticing the step's end; with async scheduling the next step is already queued.
LOAD_TURN_S = 0.0001
IDLE_POLL_MS = 1  # with no step in flight, how often a running adapter load is looked at


class Phase(enum.Enum):
    IDLE = "idle"  # no step on the device whose replies are unsent
    IN_FLIGHT = "in_flight"  # one step queued on the device; its replies go out when it completes
    STOPPED = "stopped"  # a Shutdown was handled, every reply sent
    FAILED = "failed"  # a fault was reported (WorkerFailed)


_EDGES = {
    Phase.IDLE: {Phase.IN_FLIGHT, Phase.STOPPED, Phase.FAILED},
    Phase.IN_FLIGHT: {Phase.IDLE, Phase.FAILED},  # a plan behind it: complete it (IDLE), then hold the new one
    Phase.STOPPED: set(),
    Phase.FAILED: set(),
}


class StepStalled(RuntimeError):
    """A step did not finish within the collective timeout: a tensor-parallel rank stalled."""


class WorkerLoop:
    """Applies the StepPlan and adapter-command stream in order and sends the replies.

                  StepPlan: launch it
        ┌─────────────────────────────────────┐      StepPlan: launch it, then
        │                                     ▼      complete the step before it
      IDLE ◀──────────────────────────── IN_FLIGHT ◀─┐
        │  the device finished it and no      │  └───┘
        │  command waits, or an adapter       │
        │  command arrives (loads in command  │
        │  order only), or a Shutdown:        │
        │  complete it, send its replies      │
        │ Shutdown                            │ fault: device, collective,
        ▼                                     ▼ stalled step (IDLE too)
     STOPPED (exit 0)                       FAILED (WorkerFailed sent, exit 1)

    A step's replies go out in command order: StepCompleted (rank 0), then RankDigest. With
    overlapped adapter loading an adapter command runs beside the step in flight; in every phase,
    loads that end have their replies sent between turns. `stall_s` (tensor parallelism): a step
    still running that long after its launch fails the worker (a rank stalled in a collective the
    host cannot time out, e.g. one captured in a CUDA graph)."""

    def __init__(
        self,
        runner: ModelRunner,
        rank: int,
        outbox: zmq.Socket,
        log: logging.Logger,
        overlap_loading: bool = False,
        stall_s: float | None = None,
        profile: StepProfiler | None = None,
    ) -> None:
        self.runner, self.rank, self.outbox, self.log = runner, rank, outbox, log
        self.profile = profile  # the serving-path profile's spans, when on
        self.recv_ns = 0  # when the command in hand was received
        self.overlap_loading, self.stall_s = overlap_loading, stall_s
        self.phase = Phase.IDLE
        self.in_flight: InFlightStep | None = None
        self.in_flight_since_s = 0.0
        self.num_dropped_frames = 0

    def _move(self, to: Phase) -> None:
        """The one transition function: every phase change goes through here."""
        if to not in _EDGES[self.phase]:
            raise RuntimeError(f"worker loop: illegal transition {self.phase.name} -> {to.name}")
        self.phase = to

    def run(self, inbox: zmq.Socket) -> int:
        """Serve commands until a Shutdown (0) or a fault (1)."""
        decoder = codec.to_worker_decoder()
        while self.phase not in (Phase.STOPPED, Phase.FAILED):
            if not self._wait_turn(inbox):
                break
            frame = inbox.recv()
            arrival_s, self.recv_ns = time.monotonic(), spans.now_ns()
            try:
                cmd = decoder.decode(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                self.num_dropped_frames += 1
                self.log.warning("dropped an undecodable frame (%d so far)", self.num_dropped_frames)
                continue
            self._apply(cmd, arrival_s)
        return 0 if self.phase is Phase.STOPPED else 1

    def _apply(self, cmd: events.ToWorker, arrival_s: float) -> None:
        if isinstance(cmd, events.Shutdown):
            if self.flush():
                self.log.info("shutdown: %s (%d undecodable frames dropped)", cmd.reason, self.num_dropped_frames)
                self._move(Phase.STOPPED)
        elif isinstance(cmd, events.StepPlan):
            self.launch(cmd)
        elif self.overlap_loading or self.flush():
            self._adapter_command(cmd, arrival_s)

    def _adapter_command(self, cmd: events.ToWorker, arrival_s: float) -> None:
        try:
            replies = self.runner.adapters.command(cmd, arrival_s)
        except Exception as e:
            self.fail(type(cmd).__name__, e)
            return
        for reply in replies:
            self.outbox.send(codec.encode(reply))

    def _wait_turn(self, inbox: zmq.Socket) -> bool:
        """Return once a command is waiting: the step in flight, if any, is completed when the device
        finished it first, and load replies go out meanwhile. False after a fault (reported)."""
        try:
            if self.in_flight is not None and not self.wait_for_command(inbox, self.in_flight):
                if not self.flush():  # the step is done and nothing is waiting: send its replies now
                    return False
            if self.in_flight is None:
                self._wait_idle(inbox)
        except Exception as e:
            self.fail("waiting on the device", e)
            return False
        return True

    def deadline_s(self) -> float | None:
        """When the step in flight is to be found stalled (monotonic seconds), or None."""
        return None if self.stall_s is None else self.in_flight_since_s + self.stall_s

    def wait_for_command(self, inbox: zmq.Socket, step: InFlightStep) -> bool:
        """Spin until a command is waiting (True) or the device finished `step` or it is past the
        deadline (False: time to complete it, or to find it stalled). A plan that arrives while the
        step runs is launched behind it, so the device never waits for the host."""
        return self._spin(step, self.deadline_s(), inbox)

    def _spin(self, step: InFlightStep, deadline_s: float | None, inbox: zmq.Socket | None = None) -> bool:
        """Turn until a command is waiting in `inbox`, if given (True), or the device finished `step`
        or it is past `deadline_s` (False). While loads run, their replies go out as they end, and
        each turn really sleeps a little, without the GIL: a spin that only yields it (sleep(0)) takes
        it straight back, and each of the loader threads' many acquisitions then waits out the switch
        interval."""
        while inbox is None or not inbox.poll(0):
            if step.is_done() or (deadline_s is not None and time.monotonic() > deadline_s):
                return inbox is not None and bool(inbox.poll(0))
            if self.runner.adapters.busy():
                self._send_load_replies()
                time.sleep(LOAD_TURN_S)
        return True

    def _send_load_replies(self) -> None:
        for reply in self.runner.adapters.poll():
            self.outbox.send(codec.encode(reply))

    def _wait_idle(self, inbox: zmq.Socket) -> None:
        """No step in flight: send load replies as they come due until a command is waiting or no
        load is under way any more (the caller then blocks on the socket)."""
        while self.runner.adapters.busy():
            self._send_load_replies()
            if inbox.poll(IDLE_POLL_MS):
                return
        self._send_load_replies()

    def launch(self, plan: events.StepPlan) -> bool:
        """Queue `plan` on the device, then complete the step launched before it, if any."""
        if env.fault_tp_stall(self.rank, plan.step):  # test-only switch: alive, but stuck before the collectives
            self.log.warning("stalling before step %d (test fault)", plan.step)
            time.sleep(STALL_S)
        try:
            if self.profile is not None:
                self.profile.begin(plan, self.recv_ns)
            launched = self.runner.launch(plan)
            if self.profile is not None:
                self.profile.launched(plan.step)
        except Exception as e:
            self.fail(f"step {plan.step}", e)
            return False
        launched_s = time.monotonic()
        done = self.flush()
        if done:
            self.hold(launched, launched_s)
        return done

    def hold(self, step: InFlightStep, launched_s: float) -> None:
        """`step` is now the one in flight, launched at `launched_s` (monotonic)."""
        self._move(Phase.IN_FLIGHT)
        self.in_flight, self.in_flight_since_s = step, launched_s

    def flush(self) -> bool:
        """Complete the step in flight, if any, and send its replies: StepCompleted (rank 0), then RankDigest."""
        if self.in_flight is None:
            return True
        deadline_s, in_flight = self.deadline_s(), self.in_flight
        self.in_flight = None
        try:
            self._wait_done(in_flight, deadline_s)
            completed, digest = self.runner.complete(in_flight)
        except Exception as e:
            self.fail(f"step {in_flight.step}", e)
            return False
        done_ns = spans.now_ns()
        self._move(Phase.IDLE)
        digest = maybe_fault(digest)
        frames = [codec.encode(reply) for reply in ([completed, digest] if self.rank == 0 else [digest])]
        if self.profile is not None:
            self.profile.sending(in_flight.step, done_ns)
        for frame in frames:
            self.outbox.send(frame)
        return True

    def _wait_done(self, step: InFlightStep, deadline_s: float | None) -> None:
        """Return once the device finished `step`; StepStalled past `deadline_s` (None: no bound, return
        at once, for the read-back to wait on the device without the GIL). Loads go on meanwhile: a
        tensor-parallel rank waits here for most of every step it launches behind another."""
        if deadline_s is None:
            return
        self._spin(step, deadline_s)
        if not step.is_done():
            raise StepStalled(f"still running {self.stall_s:g} s after its launch (tensor-parallel collective timeout)")

    def fail(self, what: str, e: Exception) -> None:
        """Report a fault while handling `what` (call from its except block: the traceback is logged).
        A collective that lost a rank waits first: that rank's death is the launcher's to name, and it
        stops the group well within PEER_GONE_GRACE_S; past it (no launcher noticed), this rank reports."""
        self.log.exception("%s failed", what)
        if isinstance(e, CollectiveFailed) and not e.timed_out:
            time.sleep(PEER_GONE_GRACE_S)
        self.outbox.send(codec.encode(events.WorkerFailed(self.rank, f"{what} failed: {e}")))
        self._move(Phase.FAILED)


def maybe_fault(digest: events.RankDigest) -> events.RankDigest:
    if not env.fault_digest(digest.rank, digest.step):  # test-only switch
        return digest
    return events.RankDigest(digest.step, digest.rank, digest.digest ^ 0x5A5A)
