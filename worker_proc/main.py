"""Worker process entry: `python -m worker_proc.main --config PATH --rank R`.

Receives the StepPlan stream, runs each step, returns sampled tokens (rank 0) and a
digest of what it applied (every rank)."""

from __future__ import annotations

import signal
import sys

import msgspec
import zmq

from shared import codec, events, ipc
from shared.proc import child_args, exit_with_parent, load_config, send_ready, setup_logging
from worker_proc.runner import ModelRunner


def main(argv: list[str] | None = None) -> int:
    args = child_args(argv, with_rank=True)
    log = setup_logging(f"worker-{args.rank}")
    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = load_config(args.config)
    ctx = zmq.Context.instance()
    to_scheduler = ipc.connect(ctx, zmq.PUSH, config.run_dir, ipc.SCHED_FROM_WORKERS)
    from_scheduler = ipc.connect(ctx, zmq.PULL, config.run_dir, ipc.to_worker(args.rank))
    try:
        runner = ModelRunner(config, args.rank)
        ready = runner.ready()
    except Exception as e:
        log.exception("start-up failed")
        to_scheduler.send(codec.encode(events.WorkerFailed(args.rank, f"start-up failed: {e}")))
        return 1
    log.info("ready: %d KV blocks on %s (%s)", ready.num_kv_blocks, ready.device, ready.dtype)
    to_scheduler.send(codec.encode(ready))
    send_ready(config.run_dir, f"worker-{args.rank}")
    return serve(runner, args.rank, from_scheduler, to_scheduler, log)


def serve(runner: ModelRunner, rank: int, inbox: zmq.Socket, outbox: zmq.Socket, log) -> int:
    decoder = codec.to_worker_decoder()
    while True:
        frame = inbox.recv()
        try:
            cmd = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.warning("dropped an undecodable frame")
            continue
        if isinstance(cmd, events.Shutdown):
            log.info("shutdown: %s", cmd.reason)
            return 0
        try:
            completed, digest = runner.execute(cmd)
        except Exception as e:
            log.exception("step %d failed", cmd.step)
            outbox.send(codec.encode(events.WorkerFailed(rank, f"step {cmd.step} failed: {e}")))
            return 1
        if rank == 0:
            outbox.send(codec.encode(completed))
        outbox.send(codec.encode(digest))


if __name__ == "__main__":
    sys.exit(main())
