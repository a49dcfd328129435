"""The HTTP process's side of the serving-path profile (shared/spans.py): when each engine request
reached the engine client and the scheduler's socket, when its first tokens came back and were
handed on to the response, and when the process read each batch of frames from the scheduler."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ledgerserve.shared import spans
from ledgerserve.shared.events import RequestArrived


@dataclass
class OpenRequest:
    req_id: str
    received_ns: int
    submitted_ns: int = 0
    first_output_ns: int = 0
    first_chunk_ns: int = 0


class RequestSpans:
    def __init__(self, writer: spans.SpanWriter) -> None:
        self.writer = writer
        self.open: dict[str, OpenRequest] = {}
        self.batch_recv_ns = 0  # when the batch of frames being dispatched was read

    def received(self, arrived: RequestArrived) -> OpenRequest:
        """The request was built at `arrived.arrival_time_s` (wall clock): placed on the monotonic clock."""
        now_ns = spans.now_ns()
        received_ns = now_ns - max(0, int((time.time() - arrived.arrival_time_s) * 1e9))
        item = OpenRequest(arrived.req_id, received_ns)
        self.open[arrived.req_id] = item
        return item

    def first_output(self, req_id: str) -> None:
        """Tokens of `req_id` are in the batch being dispatched."""
        item = self.open.get(req_id)
        if item is not None and not item.first_output_ns:
            item.first_output_ns = self.batch_recv_ns

    def done(self, item: OpenRequest) -> None:
        self.open.pop(item.req_id, None)
        times = (item.received_ns, item.submitted_ns, item.first_output_ns, item.first_chunk_ns, spans.now_ns())
        self.writer.add(spans.HttpRequest(item.req_id, *times))

    def batch(self, recv_ns: int, num_frames: int, num_tokens: int) -> None:
        self.writer.add(spans.HttpOutput(recv_ns, spans.now_ns(), num_frames, num_tokens))

    def close(self) -> None:
        self.writer.close()
