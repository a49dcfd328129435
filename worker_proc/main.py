"""Worker process entry: `python -m worker_proc.main --config PATH --rank R`.

Receives the StepPlan and adapter-op stream, applies each in order, returns sampled
tokens (rank 0), adapter load results and a digest of what it applied (every rank). A step
is read back only after the next plan, if one is already waiting, is queued on the device
(async scheduling); step replies go out in command order. With overlapped adapter loading an
adapter command neither waits for the step in flight nor makes any step wait (unless the step
uses that slot): its load runs beside the steps and its reply goes out when it ends."""

from __future__ import annotations

import logging
import signal
import sys
import time

import msgspec
import zmq

from ledgerserve.shared import codec, env, events, ipc
from ledgerserve.shared.proc import child_args, exit_with_parent, load_config, send_ready, setup_logging
from ledgerserve.shared.progress import ready_line
from ledgerserve.worker_proc.parallel import (
    CollectiveFailed,
    TpGroup,
    close_group,
    init_group,
    rank_device,
    share_cpu_cores,
)
from ledgerserve.worker_proc.runner import InFlightStep, ModelRunner

PEER_GONE_GRACE_S = 5.0  # how long a rank whose collective lost a peer waits for the launcher

STALL_S = 3600.0  # test-only fault: how long a stalled rank sleeps (the engine stops it long before)
# While a step runs and adapter loads are under way, each turn of the spin sleeps this long
# (0.17 ms with the timer's slack on Linux, against 1.1 ms for a 1 ms zmq poll): that much may be
# added to noticing the step's end; with async scheduling the next step is already queued.
LOAD_TURN_S = 0.0001


def main(argv: list[str] | None = None) -> int:
    args = child_args(argv, with_rank=True)
    log = setup_logging(f"worker-{args.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = load_config(args.config)
    exit_with_parent(config.run_dir)
    ctx = zmq.Context.instance()
    to_scheduler = ipc.connect(ctx, zmq.PUSH, config.run_dir, ipc.SCHED_FROM_WORKERS)
    from_scheduler = ipc.connect(ctx, zmq.PULL, config.run_dir, ipc.to_worker(args.rank))
    group = TpGroup()
    try:
        device = rank_device(config.device, args.rank)
        group = init_group(
            args.rank, config.tensor_parallel_size, config.run_dir, device, config.tp_collective_timeout_s
        )
        num_threads = share_cpu_cores(group, device)
        if num_threads is not None:
            log.info("%d CPU threads for this rank's ops (of %d ranks)", num_threads, group.size)
        runner = ModelRunner(config, args.rank, group)
        ready = runner.ready()
    except Exception as e:
        log.exception("start-up failed")
        to_scheduler.send(codec.encode(events.WorkerFailed(args.rank, f"start-up failed: {e}")))
        close_group(group)
        return 1
    log.info("ready: %s, rank %d of %d", ready_line(ready), group.rank, group.size)
    to_scheduler.send(codec.encode(ready))
    send_ready(config.run_dir, f"worker-{args.rank}")
    try:
        stall_s = config.tp_collective_timeout_s if group.size > 1 else None
        return serve(runner, args.rank, from_scheduler, to_scheduler, log, config.lora_overlap_loading, stall_s)
    finally:
        runner.close()
        close_group(group)


def serve(
    runner: ModelRunner,
    rank: int,
    inbox: zmq.Socket,
    outbox: zmq.Socket,
    log: logging.Logger,
    overlap_loading: bool = False,
    stall_s: float | None = None,
) -> int:
    """Apply the commands in order and send their replies. A StepPlan is launched as it arrives
    and completed (its replies sent) once the next plan is launched, once the device finished it
    with no command waiting, or before any other command (with `overlap_loading`, before a
    Shutdown only): step replies keep command order, and a scheduler that plans a step ahead gets
    it queued on the device while the step before runs. Adapter loads that end are reported
    between steps, as they end. `stall_s` (tensor parallelism): a step still running that long
    after its launch fails the worker (a rank stalled in a collective the host cannot time out,
    e.g. one captured in a CUDA graph)."""
    decoder = codec.to_worker_decoder()
    num_dropped_frames = 0
    loads = LoadReplies(runner, outbox)
    steps = StepReplies(runner, rank, outbox, log, loads, stall_s)
    while True:
        if not wait_turn(inbox, steps, loads):
            return 1
        frame = inbox.recv()
        arrival_s = time.monotonic()
        try:
            cmd = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            num_dropped_frames += 1
            log.warning("dropped an undecodable frame (%d so far)", num_dropped_frames)
            continue
        if isinstance(cmd, events.Shutdown):
            if not steps.flush():
                return 1
            log.info("shutdown: %s (%d undecodable frames dropped)", cmd.reason, num_dropped_frames)
            return 0
        if not run_command(cmd, arrival_s, steps, overlap_loading):
            return 1


def wait_turn(inbox: zmq.Socket, steps: StepReplies, loads: LoadReplies) -> bool:
    """Return once a command is waiting: the step in flight, if any, is completed when the device
    finished it first, and load replies go out meanwhile. False after a fault (reported): a device
    fault seen while a step or an adapter load ran."""
    try:
        if steps.in_flight is not None and not wait_for_command(inbox, steps.in_flight, loads, steps.deadline_s()):
            if not steps.flush():  # the step is done and nothing is waiting: send its replies now
                return False
        if steps.in_flight is None:
            loads.wait_idle(inbox)
    except Exception as e:
        steps.fail("waiting on the device", e)
        return False
    return True


def run_command(cmd: events.ToWorker, arrival_s: float, steps: StepReplies, overlap_loading: bool) -> bool:
    """Launch a StepPlan, or complete the step in flight (unless loads overlap the steps) and run an
    adapter command, sending its replies. False after a fault (reported)."""
    if isinstance(cmd, events.StepPlan):
        return steps.launch(cmd)
    if not overlap_loading and not steps.flush():
        return False
    try:
        replies = steps.runner.adapters.command(cmd, arrival_s)
    except Exception as e:
        steps.fail(type(cmd).__name__, e)
        return False
    for reply in replies:
        steps.outbox.send(codec.encode(reply))
    return True


def wait_for_command(
    inbox: zmq.Socket, step: InFlightStep, loads: LoadReplies, deadline_s: float | None = None
) -> bool:
    """Spin until a command is waiting (True) or the device finished `step` or it is past
    `deadline_s` (False: time to complete it, or to find it stalled). A plan that
    arrives while the step runs is launched behind it, so the device never waits for the host."""
    return spin(step, loads, deadline_s, inbox)


def spin(step: InFlightStep, loads: LoadReplies, deadline_s: float | None, inbox: zmq.Socket | None = None) -> bool:
    """Turn until a command is waiting in `inbox`, if given (True), or the device finished `step`
    or it is past `deadline_s` (False). While loads run, their replies go out as they end, and
    each turn really sleeps a little, without the GIL: a spin that only yields it (sleep(0)) takes
    it straight back, and each of the loader threads' many acquisitions then waits out the switch
    interval."""
    while inbox is None or not inbox.poll(0):
        if step.is_done() or (deadline_s is not None and time.monotonic() > deadline_s):
            return inbox is not None and bool(inbox.poll(0))
        if loads.busy():
            loads.send_due()
            time.sleep(LOAD_TURN_S)
    return True


class LoadReplies:
    """Sends the replies of adapter loads as they end."""

    IDLE_POLL_MS = 1  # with no step in flight, how often a running load is looked at

    def __init__(self, runner: ModelRunner, outbox: zmq.Socket) -> None:
        self.runner, self.outbox = runner, outbox

    def busy(self) -> bool:
        return self.runner.adapters.busy()

    def send_due(self) -> None:
        for reply in self.runner.adapters.poll():
            self.outbox.send(codec.encode(reply))

    def wait_idle(self, inbox: zmq.Socket) -> None:
        """No step in flight: send load replies as they come due until a command is waiting or no
        load is under way any more (the caller then blocks on the socket)."""
        while self.busy():
            self.send_due()
            if inbox.poll(self.IDLE_POLL_MS):
                return
        self.send_due()


class StepReplies:
    """Launches StepPlans and sends each step's replies when it completes, with at most one step
    in flight. A fault in either is reported (WorkerFailed) and the method returns False."""

    def __init__(
        self,
        runner: ModelRunner,
        rank: int,
        outbox: zmq.Socket,
        log: logging.Logger,
        loads: LoadReplies,
        stall_s: float | None = None,
    ) -> None:
        self.runner, self.rank, self.outbox, self.log, self.loads = runner, rank, outbox, log, loads
        self.stall_s = stall_s  # a step running this long after its launch fails the worker (None: no bound)
        self.in_flight: InFlightStep | None = None
        self.in_flight_since_s = 0.0

    def deadline_s(self) -> float | None:
        """When the step in flight is to be found stalled (monotonic seconds), or None."""
        return None if self.stall_s is None else self.in_flight_since_s + self.stall_s

    def launch(self, plan: events.StepPlan) -> bool:
        """Queue `plan` on the device, then complete the step launched before it, if any."""
        if env.fault_tp_stall(self.rank, plan.step):  # test-only switch: alive, but stuck before the collectives
            self.log.warning("stalling before step %d (test fault)", plan.step)
            time.sleep(STALL_S)
        try:
            launched = self.runner.launch(plan)
        except Exception as e:
            self.fail(f"step {plan.step}", e)
            return False
        launched_s = time.monotonic()
        done = self.flush()
        self.in_flight, self.in_flight_since_s = launched, launched_s
        return done

    def flush(self) -> bool:
        """Complete the step in flight, if any, and send its replies: StepCompleted (rank 0), then RankDigest."""
        if self.in_flight is None:
            return True
        deadline_s, (in_flight, self.in_flight) = self.deadline_s(), (self.in_flight, None)
        try:
            _wait_done(in_flight, self.loads, deadline_s, self.stall_s)
            completed, digest = self.runner.complete(in_flight)
        except Exception as e:
            self.fail(f"step {in_flight.step}", e)
            return False
        digest = _maybe_fault(digest)
        for reply in [completed, digest] if self.rank == 0 else [digest]:
            self.outbox.send(codec.encode(reply))
        return True

    def fail(self, what: str, e: Exception) -> None:
        """Report a fault while handling `what` (call from its except block: the traceback is logged).
        A collective that lost a rank waits first: that rank's death is the launcher's to name, and it
        stops the group well within PEER_GONE_GRACE_S; past it (no launcher noticed), this rank reports."""
        self.log.exception("%s failed", what)
        if isinstance(e, CollectiveFailed) and not e.timed_out:
            time.sleep(PEER_GONE_GRACE_S)
        self.outbox.send(codec.encode(events.WorkerFailed(self.rank, f"{what} failed: {e}")))


class StepStalled(RuntimeError):
    """A step did not finish within the collective timeout: a tensor-parallel rank stalled."""


def _wait_done(step: InFlightStep, loads: LoadReplies, deadline_s: float | None, stall_s: float | None) -> None:
    """Return once the device finished `step`; StepStalled past `deadline_s` (None: no bound, return
    at once, for the read-back to wait on the device without the GIL). Loads go on meanwhile, as in
    wait_for_command: a tensor-parallel rank waits here for most of every step it launches behind
    another."""
    if deadline_s is None:
        return
    spin(step, loads, deadline_s)
    if not step.is_done():
        raise StepStalled(f"still running {stall_s:g} s after its launch (tensor-parallel collective timeout)")


def _maybe_fault(digest: events.RankDigest) -> events.RankDigest:
    if not env.fault_digest(digest.rank, digest.step):  # test-only switch
        return digest
    return events.RankDigest(digest.step, digest.rank, digest.digest ^ 0x5A5A)


if __name__ == "__main__":
    sys.exit(main())
