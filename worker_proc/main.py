"""Worker process entry: `python -m worker_proc.main --config PATH --rank R`.

Receives the StepPlan and adapter-op stream, applies each in order, returns sampled
tokens (rank 0), adapter load results and a digest of what it applied (every rank)."""

from __future__ import annotations

import logging
import os
import signal
import sys

import msgspec
import zmq

from shared import codec, events, ipc
from shared.proc import child_args, exit_with_parent, load_config, send_ready, setup_logging
from worker_proc.runner import ModelRunner

# Test-only fault switch: this rank reports a wrong digest from this step on.
FAULT_DIGEST_RANK_ENV = "LEDGERSERVE_TEST_FAULT_DIGEST_RANK"
FAULT_DIGEST_STEP_ENV = "LEDGERSERVE_TEST_FAULT_DIGEST_STEP"


def main(argv: list[str] | None = None) -> int:
    args = child_args(argv, with_rank=True)
    log = setup_logging(f"worker-{args.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = load_config(args.config)
    exit_with_parent(config.run_dir)
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


def serve(runner: ModelRunner, rank: int, inbox: zmq.Socket, outbox: zmq.Socket, log: logging.Logger) -> int:
    decoder = codec.to_worker_decoder()
    num_dropped_frames = 0
    while True:
        frame = inbox.recv()
        try:
            cmd = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            num_dropped_frames += 1
            log.warning("dropped an undecodable frame (%d so far)", num_dropped_frames)
            continue
        if isinstance(cmd, events.Shutdown):
            log.info("shutdown: %s (%d undecodable frames dropped)", cmd.reason, num_dropped_frames)
            return 0
        try:
            replies = apply(runner, rank, cmd)
        except Exception as e:
            log.exception("%s failed", type(cmd).__name__)
            outbox.send(codec.encode(events.WorkerFailed(rank, f"{type(cmd).__name__} failed: {e}")))
            return 1
        for reply in replies:
            outbox.send(codec.encode(reply))


def apply(runner: ModelRunner, rank: int, cmd: events.Event) -> list[events.Event]:
    """One command from the scheduler -> the events to send back."""
    if isinstance(cmd, events.AdapterSlotAssigned):
        return [runner.load_adapter(cmd)]
    if isinstance(cmd, events.AdapterEvicted):
        runner.evict_adapter(cmd)
        return []
    if isinstance(cmd, events.AdapterCpuEvicted):
        runner.drop_cpu_copy(cmd)
        return []
    completed, digest = runner.execute(cmd)
    digest = _maybe_fault(digest)
    return [completed, digest] if rank == 0 else [digest]


def _maybe_fault(digest: events.RankDigest) -> events.RankDigest:
    if os.environ.get(FAULT_DIGEST_RANK_ENV) != str(digest.rank):
        return digest
    if digest.step < int(os.environ.get(FAULT_DIGEST_STEP_ENV, "1")):
        return digest
    return events.RankDigest(digest.step, digest.rank, digest.digest ^ 0x5A5A)


if __name__ == "__main__":
    sys.exit(main())
