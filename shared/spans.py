"""Timing spans of the serving path (the serving-path profile, off unless `--profile-dir` is set).

Each process writes its own file under the profile directory: when it received a frame, when it
finished each part of its work on it, when it was about to send the reply (stamped before the send,
so that no receipt can come out earlier than its send). Times are `time.monotonic_ns()`,
CLOCK_MONOTONIC, one clock for every process of the machine, so a frame's send in one process and
its receipt in another subtract to the IPC latency. Spans are diagnostics, never inputs: nothing in
them reaches the event log or changes a decision. scripts/serving/profile_serving.py joins them
with the event log (by `seq` and `step`) and reports where the time went.

File: records appended in batches, each `[u32 length][msgpack list of Span]`; a torn last batch
(a process killed mid-write) is ignored by the reader.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Iterator

import msgspec

from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog.private import make_private_dir, open_private

BATCH_HEAD = struct.Struct("<I")
FLUSH_EVERY = 512  # records held before a write: one write per ~4 steps of a full batch


class WorkerStep(msgspec.Struct, frozen=True, array_like=True, tag="worker_step"):
    """One step on one rank, from its plan's receipt to its replies' send."""

    rank: int
    step: int
    recv_ns: int  # the StepPlan frame received
    launched_ns: int  # the host queued the step (inputs built, kernels or a graph launched)
    gpu_start_ns: int  # the device began the step (CUDA event; CPU: the launch began)
    gpu_end_ns: int  # the device finished it (CUDA event; CPU: the launch returned)
    done_ns: int  # the host read its tokens back
    sent_ns: int  # its replies encoded, about to be sent
    num_reqs: int
    num_prefill_tokens: int  # tokens of requests scheduled for more than one token, or new to the rank
    num_decode_tokens: int


class SchedulerInput(msgspec.Struct, frozen=True, array_like=True, tag="scheduler_input"):
    """One input handled by the scheduler: its record in the log is `seq`."""

    seq: int
    kind: str  # the input's type name
    recv_ns: int  # the frame received
    applied_ns: int  # logged and applied to the core; the decisions encoded and written
    synced_ns: int  # the records flushed (and fsync'ed, as the policy says)
    sent_ns: int  # every decision sent
    end_ns: int  # the derived views (stats, metrics) sent: ready for the next input
    step: int = 0  # the step a StepCompleted reports
    planned_step: int = 0  # the last step a StepPlan among its decisions plans
    plan_sent_ns: int = 0  # when that StepPlan was about to go to the workers
    fsynced: bool = False


class LogSync(msgspec.Struct, frozen=True, array_like=True, tag="log_sync"):
    """One group-commit fsync of the event log (shared/eventlog/group_commit.py)."""

    seq: int  # the records up to this one became durable
    start_ns: int
    end_ns: int
    released_ns: int  # the scheduler released the frames that waited for it
    num_released: int


class HttpOutput(msgspec.Struct, frozen=True, array_like=True, tag="http_output"):
    """A batch of frames the HTTP process read from the scheduler and handed to the streams."""

    recv_ns: int
    handled_ns: int
    num_frames: int
    num_tokens: int


class HttpRequest(msgspec.Struct, frozen=True, array_like=True, tag="http_request"):
    """One engine request as the HTTP process saw it (`req_id` as logged)."""

    req_id: str
    received_ns: int  # the handler began (the body was read)
    submitted_ns: int  # about to be handed to the scheduler's socket
    first_output_ns: int  # its first tokens read from the scheduler's socket (0: none)
    first_chunk_ns: int  # its first token chunk handed to the response (0: none)
    done_ns: int


Span = WorkerStep | SchedulerInput | LogSync | HttpOutput | HttpRequest


def scheduler_input(
    seq: int, event: ev.Event, decisions: list[ev.Event], marks: tuple[int, ...], plan_sent_ns: int, fsynced: bool
) -> SchedulerInput:
    """The profile's record of one handled input (`seq`: its record's): `marks` are its receipt,
    applied, synced, sent and end times."""
    plans = [d.step for d in decisions if isinstance(d, ev.StepPlan)]
    step = event.step if isinstance(event, ev.StepCompleted) else 0
    planned = plans[-1] if plans else 0
    return SchedulerInput(seq, type(event).__name__, *marks, step, planned, plan_sent_ns, fsynced)


def now_ns() -> int:
    return time.monotonic_ns()


class SpanWriter:
    """Appends spans to `<directory>/<name>-<pid>.spans`, in batches of FLUSH_EVERY and at close."""

    def __init__(self, directory: str, name: str) -> None:
        make_private_dir(directory)
        self.path = os.path.join(directory, f"{name}-{os.getpid()}.spans")
        self._file = open_private(self.path, "xb")
        self._pending: list[Span] = []
        self._encoder = msgspec.msgpack.Encoder()

    def add(self, span: Span) -> None:
        self._pending.append(span)
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        payload = self._encoder.encode(self._pending)
        self._pending = []
        self._file.write(BATCH_HEAD.pack(len(payload)) + payload)
        self._file.flush()

    def close(self) -> None:
        if self._file.closed:
            return
        self.flush()
        self._file.close()


def open_writer(directory: str, name: str) -> SpanWriter | None:
    """The writer of process `name` when profiling is on (`directory` set), else None."""
    return SpanWriter(directory, name) if directory else None


def read_spans(path: str) -> Iterator[Span]:
    """The spans of one file, in write order; a torn last batch is left out."""
    decoder = msgspec.msgpack.Decoder(list[Span])
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset + BATCH_HEAD.size <= len(data):
        (length,) = BATCH_HEAD.unpack_from(data, offset)
        end = offset + BATCH_HEAD.size + length
        if end > len(data):
            return
        yield from decoder.decode(data[offset + BATCH_HEAD.size : end])
        offset = end
