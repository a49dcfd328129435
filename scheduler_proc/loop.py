"""The scheduler's shell: all of its IO. Receive an input, hand it to the ledger (ledger.py: log
it, apply it to the sans-IO core, log the decisions), then send each decision where the ledger
routes it. Log first, then act (docs/architecture.md, "The event log")."""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from ledgerserve.scheduler_proc.core.core import Core, CoreConfig
from ledgerserve.scheduler_proc.ledger import Ledger, Route
from ledgerserve.scheduler_proc.outbox import HeldFrames
from ledgerserve.scheduler_proc.redaction import Redactor
from ledgerserve.scheduler_proc.stats_log import StatsLog
from ledgerserve.scheduler_proc.views.adapter_stats import AdapterStats
from ledgerserve.scheduler_proc.views.engine_stats import engine_stats
from ledgerserve.scheduler_proc.views.registry_changes import registry_changes
from ledgerserve.shared import codec, events, ipc, spans
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogWriter, LogWriteError, enforce_retention
from ledgerserve.shared.proc import send_ready
from ledgerserve.shared.progress import ready_line

log = logging.getLogger("scheduler")

POLL_MS = 100


class SchedulerShell:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        ctx = zmq.Context.instance()
        self.from_tokenizer = ipc.bind(ctx, zmq.PULL, config.run_dir, ipc.SCHED_IN)
        self.from_workers = ipc.bind(ctx, zmq.PULL, config.run_dir, ipc.SCHED_FROM_WORKERS)
        self.to_tokenizer = ipc.bind(ctx, zmq.PUSH, config.run_dir, ipc.TO_TOKENIZER)
        self.to_workers = [
            ipc.bind(ctx, zmq.PUSH, config.run_dir, ipc.to_worker(rank)) for rank in range(config.tensor_parallel_size)
        ]
        self.tokenizer_decoder = codec.to_scheduler_decoder()
        self.worker_decoder = codec.from_worker_decoder()
        run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + f"-{os.getpid()}"
        writer = EventLogWriter(
            config.event_log_dir,
            config.to_json(),
            run_id,
            fsync=config.event_log_fsync,
            max_bytes=config.event_log_max_bytes,
            on_rotate=self._trim_logs,
            group_commit=True,
        )
        self.ledger = Ledger(Core(CoreConfig.from_engine(config)), writer, Redactor(config.event_log_content))
        self.adapter_stats = AdapterStats(config.tensor_parallel_size, self.core.config.lora_overlap_loading)
        self._trim_logs()
        self.num_dropped_frames = 0
        self.stop: events.LogClosed | None = None  # a stop was asked for: why (the first ask wins)
        self.failure: str | None = None  # the engine failed: why
        self.last_stats: events.EngineStats | None = None
        self.stats_log = StatsLog(config.max_loras if config.enable_lora else 0)
        self.spans = spans.open_writer(config.profile_dir, "scheduler")  # None unless profiling
        self.outbox = HeldFrames(lambda frames: self._send(self.to_tokenizer, *frames))  # until durable

    @property
    def core(self) -> Core:
        return self.ledger.core

    @property
    def log(self) -> EventLogWriter:
        return self.ledger.log

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def request_stop(self, reason: str, dead_process: str = "") -> None:
        """End the loop after the input in hand. Safe from a signal handler or another
        thread: one assignment, and the loop and any blocked send look at it often."""
        if self.stop is None:
            self.stop = events.LogClosed(reason, dead_process)

    def run(self) -> int:
        poller = zmq.Poller()
        poller.register(self.from_tokenizer, zmq.POLLIN)
        poller.register(self.from_workers, zmq.POLLIN)
        if self.log.wake_fd is not None:
            poller.register(self.log.wake_fd, zmq.POLLIN)
        log.info("event log: %s (request content: %s)", self.log.path, self.config.event_log_content)
        try:
            while self.stop is None and not self.failed:
                for sock, _ in poller.poll(POLL_MS):
                    if sock == self.log.wake_fd:
                        self._on_synced()
                    else:
                        self._receive(sock)
                self.stats_log.tick(time.monotonic())
        except Exception as exc:
            self.failure = f"scheduler error: {exc!r}"
            raise
        finally:
            self._close()
        return 1 if self.failed else 0

    def _receive(self, sock: zmq.Socket) -> None:
        frame = sock.recv()
        recv_ns = spans.now_ns()
        decoder = self.tokenizer_decoder if sock is self.from_tokenizer else self.worker_decoder
        try:
            event = decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.num_dropped_frames += 1
            log.warning("dropped an undecodable frame (%d so far)", self.num_dropped_frames)
            return
        self.handle(event, recv_ns)

    def handle(self, event: events.Event, recv_ns: int = 0) -> None:
        if self.failed:
            return
        try:
            routed = self.ledger.write(event)
            applied_ns = spans.now_ns()
            self.ledger.commit(routed)
        except LogWriteError as exc:
            self._stop_unlogged(exc)
            return
        synced_ns = spans.now_ns()
        decisions = [r.decision for r in routed]
        self._send_registry_changes(decisions)
        plan_sent_ns = 0
        for decision, frame, where in routed:
            if isinstance(decision, events.StepPlan):
                plan_sent_ns = spans.now_ns()
            self._send_decision(decision, frame, where)
        sent_ns = spans.now_ns()
        self._fold_adapter_stats(event, decisions)
        if isinstance(event, events.WorkerReady) and self.core.scheduler.is_ready:
            self._on_engine_ready(event)  # the last rank's WorkerReady made the core ready
        self._send_stats()
        self.stats_log.record(decisions, self.last_stats, time.monotonic())
        self.outbox.release(self.log.durable_seq)
        if self.spans is not None:
            marks = (recv_ns or applied_ns, applied_ns, synced_ns, sent_ns, spans.now_ns())
            seq = self.log.last_seq - len(routed)
            self.spans.add(spans.scheduler_input(seq, event, decisions, marks, plan_sent_ns, self.log.last_fsynced))

    def _fold_adapter_stats(self, event: events.Event, decisions: list[events.Event]) -> None:
        """Per-adapter figures from what was just logged, in log order; each slot load that
        ended on every rank goes to /metrics (derived, so not logged)."""
        for record in [event, *decisions]:
            for load in self.adapter_stats.fold(record):
                observed = events.AdapterLoadObserved(load.name, load.version_id, load.source_tier, load.duration_ms)
                self._to_tokenizer(codec.encode(observed))

    def _send_registry_changes(self, decisions: list[events.Event]) -> None:
        """What the decisions changed in the adapter registry, before them (derived, so not logged)."""
        change = registry_changes(self.core.adapters, decisions)
        if change is not None:
            self._to_tokenizer(codec.encode(change))

    def _stop_unlogged(self, exc: LogWriteError) -> None:
        """Never serve what is not logged: fail every request and stop the engine. The
        clients are told why without the log's path; the server's log names it."""
        log.error("stopping the engine: cannot write the event log (%s)", exc)
        message = f"stopping the engine: cannot write the event log ({exc.reason})"
        self._send(self.to_tokenizer, codec.encode(events.EngineFailed(message)))
        self.failure = message

    def _trim_logs(self) -> None:
        """Retention (--event-log-max-total-bytes), at start and at each rotation: the oldest
        runs, then this run's oldest segments, never the segment being written. A failure is
        logged, not fatal: a disk that then fills stops the engine through the writer."""
        max_total_bytes, reserve_bytes = self.config.event_log_max_total_bytes, self.config.event_log_max_bytes
        if not max_total_bytes:
            return
        try:
            removed, num_bytes = enforce_retention(
                self.config.event_log_dir, max_total_bytes, self.log.current_path, reserve_bytes
            )
        except OSError as exc:
            log.warning("event-log retention failed: %s", exc)
            return
        for path in removed:
            log.info("event-log retention removed %s", path)
        if num_bytes + reserve_bytes > max_total_bytes:
            log.warning(
                "event-log directory %s holds %d bytes (+%d for the segment being written), over its bound "
                "of %d: the rest is this run's newest segment or runs another engine is writing",
                self.config.event_log_dir,
                num_bytes,
                reserve_bytes,
                max_total_bytes,
            )

    def _send_stats(self) -> None:
        """Gauges for /metrics, sent when they change (not logged: derived from logged state).
        Per-adapter rows go only when they changed: the cost of a step stays with the
        adapters its events touched, however many are registered."""
        stats = engine_stats(self.core, self.adapter_stats.take_changed_rows(), self.adapter_stats.lora_wait_ms)
        if stats != self.last_stats:
            self._to_tokenizer(codec.encode(stats))
            self.last_stats = stats

    def _send_decision(self, decision: events.Event, frame: bytes, where: Route) -> None:
        if where is Route.WORKERS:
            for sock in self.to_workers:
                self._send(sock, frame)
        elif where is Route.TOKENIZER:
            self._to_tokenizer(frame)
        if isinstance(decision, events.EngineFailed):
            log.error("engine failed: %s", decision.message)
            self.failure = decision.message

    def _to_tokenizer(self, frame: bytes) -> None:
        """To the HTTP process once the records written so far are durable (outbox.py)."""
        self.outbox.put(self.log.last_seq, frame)

    def _on_synced(self) -> None:
        """A group-commit fsync ended: release what it made durable (or stop: it failed)."""
        try:
            synced = self.log.check_synced()
        except LogWriteError as exc:
            self._stop_unlogged(exc)
            return
        released_ns, num_frames = spans.now_ns(), self.outbox.release(self.log.durable_seq)
        if self.spans is not None:
            for seq, start_ns, end_ns in synced:
                self.spans.add(spans.LogSync(seq, start_ns, end_ns, released_ns, num_frames))

    def _send(self, sock: zmq.Socket, *frames: bytes) -> None:
        """Send the frames as one message, waiting while the peer's queue is full, but never past a
        stop request: a peer that died leaves no pipe to send on, and the launcher then stops this process."""
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.stop is not None:
                    log.warning("stopping: dropped a frame for a peer that takes none")
                    return
                sock.poll(POLL_MS, zmq.POLLOUT)

    def _on_engine_ready(self, ready: events.WorkerReady) -> None:
        """Capacity as the core uses it: the smallest pool over the ranks."""
        num_total_blocks = self.core.scheduler.block_manager.num_total_blocks
        ranks = [self.core.ready[rank] for rank in sorted(self.core.ready)]
        facts = "; ".join(f"rank {r.rank}: {ready_line(r)}" for r in ranks)
        log.info("engine ready: %d KV blocks (the smallest pool of the ranks); %s", num_total_blocks, facts)
        self._to_tokenizer(codec.encode(events.EngineReady(num_total_blocks, ready.vocab_size)))
        send_ready(self.config.run_dir, "scheduler")

    def _close(self) -> None:
        """Never raises or blocks: Shutdown to every worker that takes it, then LogClosed
        appended and synced, then every socket closed without linger."""
        closed = self._closed_record()
        self.stats_log.flush(time.monotonic())  # the open interval's line, if any
        shutdown = codec.encode(events.Shutdown(closed.reason))
        for rank, sock in enumerate(self.to_workers):
            try:
                sock.send(shutdown, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # zmq.Again: the worker is gone
                log.warning("could not tell worker-%d to shut down: %s", rank, exc)
        try:
            self.log.append(closed)
            self.log.close()
            self.outbox.release(self.log.durable_seq)  # the close synced every record
        except (LogWriteError, ValueError) as exc:
            log.error("could not close the event log cleanly: %s", exc)
            self.failure = self.failure or str(exc)
        finally:
            self.log.close()  # once more after a write error: closes the file, removes a run with no record
        log.info("closed the event log (%s) after %d dropped frames", closed.reason, self.num_dropped_frames)
        if self.spans is not None:
            self.spans.close()
        for sock in (self.from_tokenizer, self.from_workers, self.to_tokenizer, *self.to_workers):
            sock.close(linger=0)

    def _closed_record(self) -> events.LogClosed:
        """Why the log ends. The engine's own failure first; else a death the launcher
        reported (its notice names the process and exit code; it SIGTERMs this process
        after writing it); else the stop that was asked for."""
        if self.failure is not None:
            return events.LogClosed(f"engine failed: {self.failure}")
        notice = ipc.read_death_notice(self.config.run_dir)
        if notice is not None:
            return events.LogClosed(notice.message, notice.process, notice.exit_code)
        return self.stop or events.LogClosed("stopped")
