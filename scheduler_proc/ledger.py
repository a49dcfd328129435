"""The scheduler's order of record, without sockets: an input is logged, applied to the sans-IO
core, its decisions logged and committed (fsync per policy), and only then does each go where its
type travels. Replay relies on this order. The scheduler's shell (loop.py, zmq) and the in-process
engine (ledgerserve/engine.py) both go through `Ledger`, and both route by `route` below.

    ledger = Ledger(core, EventLogWriter(...), Redactor(config.event_log_content))
    for decision, frame, where in ledger.apply(event):
        ...  # send `frame` to the workers or the HTTP process, as `where` says
"""

from __future__ import annotations

import enum
import typing
from typing import NamedTuple

from ledgerserve.scheduler_proc.core import Core
from ledgerserve.scheduler_proc.redaction import Redactor
from ledgerserve.shared import codec, events
from ledgerserve.shared.eventlog import EventLogWriter

# A decision travels on the channel whose union (shared/events.py) holds its type; the rest
# (RequestFinished, StateDigest, AdapterRegistered, ...) are the core's record, logged only.
TO_WORKER_TYPES: tuple[type, ...] = tuple(t for t in typing.get_args(events.ToWorker) if t in events.DECISION_TYPES)
TO_TOKENIZER_TYPES: tuple[type, ...] = tuple(
    t for t in typing.get_args(events.FromScheduler) if t in events.DECISION_TYPES
)


class Route(enum.Enum):
    WORKERS = "workers"  # every rank, in decision order
    TOKENIZER = "tokenizer"  # the HTTP process
    LOG_ONLY = "log_only"  # kept in the log, sent nowhere


ROUTES: dict[type, Route] = {cls: Route.WORKERS for cls in TO_WORKER_TYPES}
ROUTES.update({cls: Route.TOKENIZER for cls in TO_TOKENIZER_TYPES})


def route(decision: events.Event) -> Route:
    """Where a decision goes once it is logged."""
    return ROUTES.get(type(decision), Route.LOG_ONLY)


class Routed(NamedTuple):
    """One logged decision, ready to send."""

    decision: events.Event  # as sent: request content restored by the redactor
    frame: bytes  # its encoding, as sent
    route: Route


class Ledger:
    """The core behind its log. `content` (redaction.py) turns each input into what is logged and
    applied, and each logged decision into what is sent (the identity for `--event-log-content
    tokens`)."""

    def __init__(self, core: Core, log: EventLogWriter, content: Redactor | None = None) -> None:
        self.core = core
        self.log = log
        self.content = content if content is not None else Redactor("tokens")

    def apply(self, event: events.Event) -> list[Routed]:
        """Log the input, apply it, log the decisions and commit them; then where each decision goes. A
        decision sent as logged is encoded once: the same bytes go to the log and to the socket."""
        routed = self.write(event)
        self.commit(routed)
        return routed

    def write(self, event: events.Event) -> list[Routed]:
        """`apply` up to the commit: the records are written, not yet flushed or synced."""
        event = self.content.inbound(event)
        self.log.append(event)
        routed: list[Routed] = []
        for decision in self.core.apply(event):
            frame = codec.encode(decision)
            self.log.append(decision, frame)
            sent = self.content.outbound(decision)
            routed.append(Routed(sent, frame if sent is decision else codec.encode(sent), route(decision)))
        return routed

    def commit(self, routed: list[Routed]) -> None:
        """End of one input's records: flush, and fsync as the policy says."""
        self.log.commit(step_planned=any(isinstance(r.decision, events.StepPlan) for r in routed))
