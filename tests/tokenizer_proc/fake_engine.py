"""An in-process fake engine: it echoes each request's prompt tokens back, one per event.

Built on EngineClientBase, so the per-request queues and dispatch are the real ones; only
the transport is replaced. Records every event it receives, for assertions.
"""

from __future__ import annotations

import asyncio

from shared.events import (
    EngineFailed,
    Event,
    RequestAborted,
    RequestArrived,
    RequestRejected,
    TokenLogprobs,
    TokensEmitted,
)
from tokenizer_proc.engine_client import EngineClientBase


class FakeEngine(EngineClientBase):
    def __init__(self, delay_s: float = 0.0, num_cached_tokens: int = 0) -> None:
        super().__init__()
        self.is_ready = True
        self.delay_s = delay_s
        self.num_cached_tokens = num_cached_tokens
        self.received: list[Event] = []
        self.script: list[int] | None = None  # ids to emit instead of the echo
        self.reject_all: str | None = None
        self.eos_token_id: int | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.aborted = asyncio.Event()

    @property
    def aborts(self) -> list[RequestAborted]:
        return [e for e in self.received if isinstance(e, RequestAborted)]

    @property
    def arrivals(self) -> list[RequestArrived]:
        return [e for e in self.received if isinstance(e, RequestArrived)]

    async def _send(self, event: Event) -> None:
        self.received.append(event)
        if isinstance(event, RequestArrived):
            if self.reject_all is not None:
                self._dispatch(RequestRejected(event.req_id, self.reject_all, 400, "prompt"))
                return
            self._tasks[event.req_id] = asyncio.get_running_loop().create_task(self._emit(event))
        elif isinstance(event, RequestAborted):
            task = self._tasks.pop(event.req_id, None)
            if task is not None:
                task.cancel()
            self.aborted.set()

    def fail(self, message: str) -> None:
        self._dispatch(EngineFailed(message))

    async def _emit(self, arrived: RequestArrived) -> None:
        ids = self._output_ids(arrived)
        params = arrived.sampling
        for index, token_id in enumerate(ids):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = index == len(ids) - 1
            is_eos = token_id == self.eos_token_id
            logprobs = None
            if params.logprobs is not None:
                top_ids = [token_id, (token_id + 1) % 100][: params.logprobs]
                logprobs = [TokenLogprobs(-0.25, top_ids, [-0.25, -1.5][: len(top_ids)])]
            self._dispatch(
                TokensEmitted(
                    req_id=arrived.req_id,
                    new_token_ids=[token_id],
                    finish_reason=("stop" if is_eos else "length") if last or is_eos else None,
                    logprobs=logprobs,
                    num_prompt_tokens=len(arrived.prompt_token_ids),
                    num_cached_tokens=self.num_cached_tokens,
                    stop_token_id=token_id if is_eos else None,
                )
            )
            if is_eos:
                break
            await asyncio.sleep(0)
        self._tasks.pop(arrived.req_id, None)

    def _output_ids(self, arrived: RequestArrived) -> list[int]:
        if self.script is not None:
            return self.script[: arrived.sampling.max_tokens]
        prompt = arrived.prompt_token_ids
        max_tokens = arrived.sampling.max_tokens
        return [prompt[i % len(prompt)] for i in range(max_tokens)]
