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

import zmq

from ledgerserve.shared import codec, events, ipc, spans
from ledgerserve.shared.gc_tuning import settle_after_start
from ledgerserve.shared.proc import child_args, exit_with_parent, load_config, send_ready, setup_logging
from ledgerserve.shared.progress import ready_line
from ledgerserve.worker_proc.loop import WorkerLoop
from ledgerserve.worker_proc.parallel import TpGroup, close_group, init_group, rank_device, share_cpu_cores
from ledgerserve.worker_proc.runner import ModelRunner
from ledgerserve.worker_proc.step_profile import StepProfiler


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
    settle_after_start()
    to_scheduler.send(codec.encode(ready))
    send_ready(config.run_dir, f"worker-{args.rank}")
    try:
        stall_s = config.tp_collective_timeout_s if group.size > 1 else None
        overlap = config.lora_overlap_loading
        return serve(runner, args.rank, from_scheduler, to_scheduler, log, overlap, stall_s, config.profile_dir)
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
    profile_dir: str = "",
) -> int:
    """Apply the commands in order and send their replies (loop.py: WorkerLoop); the exit code.
    `profile_dir`: where the serving-path profile's spans go (none: not profiled)."""
    writer = spans.open_writer(profile_dir, f"worker-{rank}")
    profile = StepProfiler(writer, rank, runner.device) if writer is not None else None
    try:
        return WorkerLoop(runner, rank, outbox, log, overlap_loading, stall_s, profile).run(inbox)
    finally:
        if profile is not None:
            profile.close()


if __name__ == "__main__":
    sys.exit(main())
