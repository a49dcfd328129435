"""What the HTTP process sees of one engine request (one choice), for vLLM's request metrics.

Times are wall-clock seconds, as `RequestArrived.arrival_time_s` is. The process sees the
request's arrival (stamped when the engine request is built), its hand-off to the scheduler,
each output carrying tokens, and its end; it does not see when the scheduler first schedules
the request. So the phases it reports are arrival -> hand-off (queue here), hand-off -> first
token (the scheduler's queue and the prefill) and first -> last token (decode).

The finish reason is the one the client sees: `stop` (EOS, a stop token or a stop string),
`length`, `abort` (the client went away or the request was cancelled, or the engine aborted
it) or `error` (the engine failed it: a 5xx). A request the engine refused (4xx) never ran
and is not counted."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ledgerserve.shared.events import RequestArrived


class RequestObserver(Protocol):
    def on_first_token(self, trace: RequestTrace) -> None:
        """The request's first tokens arrived: its prompt was processed."""

    def on_tokens(self, trace: RequestTrace, num_tokens: int, gap_s: float | None) -> None:
        """`num_tokens` more output tokens; `gap_s`: since the previous ones (None for the first)."""

    def on_finished(self, trace: RequestTrace) -> None:
        """The request ended with `trace.finish_reason`."""


@dataclass
class RequestTrace:
    arrived: RequestArrived
    observer: RequestObserver | None
    sent_time_s: float = field(default_factory=time.time)  # handed to the scheduler
    first_token_time_s: float | None = None
    last_token_time_s: float | None = None
    finish_time_s: float | None = None
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    is_done: bool = False  # finished, or refused and not counted

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.arrived.prompt_token_ids)

    def on_tokens(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Output tokens the client gets (as `usage` counts them); the prefix-cache hits so far."""
        if num_tokens <= 0 or self.is_done:
            return
        now_s = time.time()
        self.num_cached_tokens = num_cached_tokens
        gap_s = None if self.last_token_time_s is None else max(0.0, now_s - self.last_token_time_s)
        if self.first_token_time_s is None:
            self.first_token_time_s = now_s
            if self.observer is not None:
                self.observer.on_first_token(self)
        self.last_token_time_s = now_s
        self.num_generation_tokens += num_tokens
        if self.observer is not None:
            self.observer.on_tokens(self, num_tokens, gap_s)

    def finish(self, reason: str) -> None:
        """The request ended; only the first call counts."""
        if self.is_done:
            return
        self.is_done = True
        self.finish_reason, self.finish_time_s = reason, time.time()
        if self.observer is not None:
            self.observer.on_finished(self)

    def fail(self, status_code: int) -> None:
        """The engine failed (5xx: counted as `error`) or refused (4xx: never ran, not counted) it."""
        if status_code >= 500:
            self.finish("error")
        self.is_done = True

    # The phases, in seconds (never negative should the wall clock step back).
    def e2e_s(self) -> float:
        return _span(self.arrived.arrival_time_s, self.finish_time_s)

    def queue_s(self) -> float:
        return _span(self.arrived.arrival_time_s, self.sent_time_s)

    def ttft_s(self) -> float:
        return _span(self.arrived.arrival_time_s, self.first_token_time_s)

    def prefill_s(self) -> float:
        """Hand-off to the first token; without one, to the end."""
        end_s = self.first_token_time_s if self.first_token_time_s is not None else self.finish_time_s
        return _span(self.sent_time_s, end_s)

    def decode_s(self) -> float:
        if self.first_token_time_s is None:
            return 0.0
        return _span(self.first_token_time_s, self.last_token_time_s)


def _span(start_s: float, end_s: float | None) -> float:
    return 0.0 if end_s is None else max(0.0, end_s - start_s)
