"""The tokenizer process's view of the engine: send requests, stream their tokens back.

`EngineClientBase` holds the per-request queues and the dispatch of scheduler events;
subclasses only send events (`_send`) and feed what they receive to `_dispatch`.
`EngineClient` (engine_socket.py) does that over ZeroMQ (PUSH to the scheduler, PULL from it);
tests use an in-process fake built on the same base.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import AsyncIterator, Callable

from ledgerserve.shared import spans
from ledgerserve.shared.events import (
    AdapterInfo,
    AdapterLoadObserved,
    AdapterLoadRequested,
    AdapterOpReplied,
    AdapterRegistryChanged,
    AdapterRow,
    AdapterUnloadRequested,
    EngineFailed,
    EngineReady,
    EngineStats,
    Event,
    RequestAborted,
    RequestArrived,
    RequestRejected,
    TokensEmitted,
)
from ledgerserve.tokenizer_proc.live_ids import LiveRequestIds
from ledgerserve.tokenizer_proc.mailbox import Mailbox
from ledgerserve.tokenizer_proc.request_spans import RequestSpans
from ledgerserve.tokenizer_proc.request_trace import RequestObserver

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """A request failed in the engine; carries an HTTP status and OpenAI error fields."""

    status_code = 500
    error_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestRejectedError(EngineError):
    error_type = "BadRequestError"

    def __init__(self, message: str, code: int = 400, param: str | None = None) -> None:
        super().__init__(message, param)
        self.status_code = code
        if code >= 500:  # the worker failed this request alone (e.g. its adapter would not load)
            self.error_type = "ServiceUnavailableError" if code == 503 else "InternalServerError"


class EngineDeadError(EngineError):
    status_code = 503
    error_type = "ServiceUnavailableError"


class EngineClientBase(abc.ABC):
    def __init__(self) -> None:
        self._queues: dict[str, Mailbox] = {}  # req id -> its outputs not yet read
        self._pending_aborts: set[asyncio.Task[None]] = set()
        self.is_healthy = True  # False once the engine has failed
        self.is_ready = False  # True once every worker rank is up (EngineReady)
        self.is_draining = False  # True after SIGTERM: in-flight requests finish, new ones get 503
        self.stats: EngineStats | None = None  # the scheduler's latest gauges
        self.adapter_rows: dict[str, AdapterRow] = {}  # registered adapter -> its latest row (EngineStats)
        self.load_listeners: list[Callable[[AdapterLoadObserved], None]] = []
        self.finished_listeners: list[Callable[[RequestArrived, TokensEmitted], None]] = []
        self.request_observer: RequestObserver | None = None  # sees each request's tokens and end (vLLM's metrics)
        self.failure_message: str | None = None
        self.num_bad_frames = 0
        self._ops: dict[str, asyncio.Future[AdapterOpReplied]] = {}
        self.adapters: dict[str, AdapterInfo] = {}  # the core's registry, from its AdapterRegistryChanged
        self._num_ops = 0
        self._live = LiveRequestIds()  # sent, without the core's last word on them yet
        # Called with the core's whole adapter registry after each change of it.
        self.on_adapters: Callable[[list[AdapterInfo]], None] | None = None
        self.spans: RequestSpans | None = None  # the serving-path profile's, when on

    @abc.abstractmethod
    async def _send(self, event: Event) -> None:
        """Deliver one event to the scheduler."""

    async def start(self) -> None:  # noqa: B027 - a hook: clients without background work keep it
        """Start background work (readers); idempotent."""

    async def close(self) -> None:  # noqa: B027 - a hook, as start
        """Stop background work and release sockets."""

    async def wait_staged(self, names: list[str], max_cpu_loras: int) -> None:  # noqa: B027 - a hook, as start
        """Wait until the engine staged the start-up adapters `names` (as many as its CPU tier holds).
        An engine that sends no gauges (an in-process one) has nothing to wait for."""

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def is_in_flight(self, req_id: str) -> bool:
        """Whether `req_id` names a request that has not ended: its id cannot be used again yet."""
        return req_id in self._queues or req_id in self._live

    def next_op_id(self) -> str:
        """A fresh adapter op id: `lora-op-N`, counted per process (the same ops give the same ids)."""
        self._num_ops += 1
        return f"lora-op-{self._num_ops}"

    def unavailable_reason(self) -> str | None:
        """Why new work is refused with 503 (engine failed, or draining); None: accepted."""
        if not self.is_healthy:
            return self.failure_message or "engine is not healthy"
        if self.is_draining:
            return "the server is shutting down"
        return None

    def engine_died(self, message: str) -> None:
        """An engine process is gone (the launcher said so): fail all in-flight work now."""
        if self.is_healthy:
            logger.error("engine failed: %s", message)
            self._fail_all(message)

    async def generate(self, arrived: RequestArrived) -> AsyncIterator[TokensEmitted]:
        """Send `arrived`, then yield its TokensEmitted until one carries a finish reason.

        Leaving early (the consumer stops iterating, or is cancelled) aborts the request."""
        if (reason := self.unavailable_reason()) is not None:
            raise EngineDeadError(reason)
        if self.is_in_flight(arrived.req_id):
            raise RequestRejectedError(f"Request id `{arrived.req_id}` is already in flight.", 400, "X-Request-Id")
        queue = Mailbox()
        self._queues[arrived.req_id] = queue
        span = self.spans.received(arrived) if self.spans is not None else None
        try:
            if span is not None:
                span.submitted_ns = spans.now_ns()
            await self._live.send(self._send, arrived)
            while True:
                item = await queue.get()
                if isinstance(item, EngineError):
                    self._queues.pop(arrived.req_id, None)
                    raise item
                if item.finish_reason is not None:
                    self._queues.pop(arrived.req_id, None)
                    self._notify_finished(arrived, item)
                yield item
                if span is not None and not span.first_chunk_ns and item.new_token_ids:
                    span.first_chunk_ns = spans.now_ns()  # the consumer is back: it handed the chunk on
                if item.finish_reason is not None:
                    return
        finally:
            if self._queues.pop(arrived.req_id, None) is not None:
                self._abort_soon(arrived.req_id, "abort")
            if span is not None and self.spans is not None:
                self.spans.done(span)

    async def adapter_op(self, op: AdapterLoadRequested | AdapterUnloadRequested) -> AdapterOpReplied:
        """Send an adapter load/unload and wait for the core's reply to its op_id."""
        if not self.is_healthy:
            raise EngineDeadError(self.failure_message or "engine is not healthy")
        if op.op_id in self._ops:
            raise EngineError(f"duplicate adapter op id {op.op_id!r}")
        future: asyncio.Future[AdapterOpReplied] = asyncio.get_running_loop().create_future()
        self._ops[op.op_id] = future
        try:
            await self._send(op)
            return await future
        finally:
            self._ops.pop(op.op_id, None)

    def _notify_finished(self, arrived: RequestArrived, last: TokensEmitted) -> None:
        for listener in self.finished_listeners:
            listener(arrived, last)

    async def abort(self, req_id: str, reason: str = "abort") -> None:
        """Tell the engine to stop `req_id`; its stream gets nothing more."""
        self._queues.pop(req_id, None)
        await self._send(RequestAborted(req_id=req_id, reason=reason))

    def release(self, req_id: str) -> None:
        """Synchronous cleanup for a consumer that is going away (safe under cancellation):
        if `req_id` is still in flight, forget it and abort it in the engine."""
        if self._queues.pop(req_id, None) is not None:
            self._abort_soon(req_id, "abort")

    def _abort_soon(self, req_id: str, reason: str) -> None:
        # Called from a finally block that may be running under cancellation: send from
        # a task of its own so the abort still goes out.
        task = asyncio.get_running_loop().create_task(self._send_quietly(RequestAborted(req_id, reason)))
        self._pending_aborts.add(task)
        task.add_done_callback(self._pending_aborts.discard)

    async def _send_quietly(self, event: Event) -> None:
        try:
            await self._send(event)
        except Exception:  # the socket is gone; nothing left to abort
            logger.exception("could not send %s", type(event).__name__)

    def _dispatch(self, event: Event) -> None:
        """Route one event from the scheduler to the stream waiting for it."""
        if isinstance(event, EngineFailed):
            self._fail_all(event.message)
            return
        if isinstance(event, EngineReady):
            self.is_ready = True
            return
        if isinstance(event, EngineStats):
            self.stats = event
            self.adapter_rows.update((row.name, row) for row in event.adapter_rows)
            return
        if isinstance(event, AdapterLoadObserved):
            for listener in self.load_listeners:
                listener(event)
            return
        if isinstance(event, AdapterRegistryChanged):
            self._on_registry_changed(event)
            return
        if isinstance(event, AdapterOpReplied):
            self._on_op_replied(event)
            return
        if isinstance(event, (TokensEmitted, RequestRejected)):
            self._live.note(event)
            if self.spans is not None and isinstance(event, TokensEmitted) and event.new_token_ids:
                self.spans.first_output(event.req_id)
            queue = self._queues.get(event.req_id)
            if queue is None:
                return  # aborted or unknown: drop
            if isinstance(event, RequestRejected):
                queue.put(RequestRejectedError(event.message, event.code, event.param))
            else:
                queue.put(event)
            return
        self.num_bad_frames += 1  # decodes, but has no business on this channel

    def _on_registry_changed(self, change: AdapterRegistryChanged) -> None:
        """The core sends what an input changed before that input's decisions: whoever awaits an
        op's reply sees the registry as the op left it."""
        for name in change.unregistered:
            self.adapters.pop(name, None)
        self.adapters.update((info.name, info) for info in change.registered)
        self.adapter_rows = {name: row for name, row in self.adapter_rows.items() if name in self.adapters}
        if self.on_adapters is not None:
            self.on_adapters(sorted(self.adapters.values(), key=lambda info: info.name))

    def _on_op_replied(self, reply: AdapterOpReplied) -> None:
        future = self._ops.get(reply.op_id)
        if future is not None and not future.done():
            future.set_result(reply)

    def _fail_all(self, message: str) -> None:
        self.is_healthy = False
        self.failure_message = message
        self._live.clear()
        for queue in self._queues.values():
            queue.put(EngineDeadError(f"engine failed: {message}"))
        for future in self._ops.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"engine failed: {message}"))
