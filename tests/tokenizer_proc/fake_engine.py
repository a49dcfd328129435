"""An in-process fake engine: it echoes each request's prompt tokens back, one per event.
A request asking for prompt logprobs first gets them in two chunks (fake_prompt_logprobs).

It answers adapter ops like the core: a registry of name -> version, 400 for a duplicate
load (unless load_inplace), 404 for unloading an unknown name, and a 404 RequestRejected
for a request naming an adapter that is not registered (e.g. unloaded in between).

Built on EngineClientBase, so the per-request queues and dispatch are the real ones; only
the transport is replaced. Records every event it receives, for assertions.
"""

from __future__ import annotations

import asyncio

from ledgerserve.shared import codec
from ledgerserve.shared.events import (
    AdapterInfo,
    AdapterLoadRequested,
    AdapterOpReplied,
    AdapterUnloadRequested,
    EngineFailed,
    Event,
    PromptLogprobs,
    RequestAborted,
    RequestArrived,
    RequestRejected,
    TokenLogprobs,
    TokensEmitted,
)
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase


class FakeEngine(EngineClientBase):
    def __init__(self, delay_s: float = 0.0, num_cached_tokens: int = 0, op_delay_s: float = 0.0) -> None:
        super().__init__()
        self.op_delay_s = op_delay_s  # time the "core" takes to answer an adapter op
        self.registry: dict[str, AdapterInfo] = {}
        self.refuse_loads: str | None = None  # answer every load with this message ...
        self.refuse_code = 400  # ... and this code
        self._next_version = 1
        self._op_lock = asyncio.Lock()
        self.is_ready = True
        self.delay_s = delay_s
        self.num_cached_tokens = num_cached_tokens
        self.received: list[Event] = []
        self.script: list[int] | None = None  # ids to emit instead of the echo
        self.logprob_values = (-0.25, -1.5)  # the sampled token's logprob, and the second top one's
        self.reject_all: str | None = None
        self.eos_token_id: int | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.aborted = asyncio.Event()
        self.hold: asyncio.Event | None = None  # when set: requests wait for it before emitting
        self.encode_events = False  # encode each event like the real transport (catches overflows)
        self.prompt_delay_s = 0.0  # before a request's prompt logprobs (its first tokens wait too)

    @property
    def aborts(self) -> list[RequestAborted]:
        return [e for e in self.received if isinstance(e, RequestAborted)]

    @property
    def arrivals(self) -> list[RequestArrived]:
        return [e for e in self.received if isinstance(e, RequestArrived)]

    async def _send(self, event: Event) -> None:
        if self.encode_events:
            codec.encode(event)
        self.received.append(event)
        if isinstance(event, (AdapterLoadRequested, AdapterUnloadRequested)):
            self._tasks[event.op_id] = asyncio.get_running_loop().create_task(self._answer_op(event))
        elif isinstance(event, RequestArrived):
            if self.reject_all is not None:
                self._dispatch(RequestRejected(event.req_id, self.reject_all, 400, "prompt"))
                return
            if event.lora_name is not None and event.lora_name not in self.registry:
                message = f"The lora adapter '{event.lora_name}' cannot be found."
                self._dispatch(RequestRejected(event.req_id, message, 404, "model"))
                return
            self._tasks[event.req_id] = asyncio.get_running_loop().create_task(self._emit(event))
        elif isinstance(event, RequestAborted):
            task = self._tasks.pop(event.req_id, None)
            if task is not None:
                task.cancel()
            self.aborted.set()

    async def _answer_op(self, op: AdapterLoadRequested | AdapterUnloadRequested) -> None:
        async with self._op_lock:  # the core handles ops one at a time, in arrival order
            if self.op_delay_s:
                await asyncio.sleep(self.op_delay_s)
            code, message, version_id = self._apply_op(op)
            self._dispatch(AdapterOpReplied(op.op_id, code, message, version_id, list(self.registry.values())))
        self._tasks.pop(op.op_id, None)

    def _apply_op(self, op: AdapterLoadRequested | AdapterUnloadRequested) -> tuple[int, str, int]:
        if isinstance(op, AdapterUnloadRequested):
            if self.registry.pop(op.name, None) is None:
                return 404, f"The lora adapter '{op.name}' cannot be found.", 0
            return 200, "", 0
        if self.refuse_loads is not None:
            return self.refuse_code, self.refuse_loads, 0
        if op.name in self.registry and not op.load_inplace:
            return 400, f"The lora adapter '{op.name}' has already been loaded.", 0
        version_id, self._next_version = self._next_version, self._next_version + 1
        self.registry[op.name] = AdapterInfo(op.name, version_id, op.path, op.pinned, op.on_demand)
        return 200, "", version_id

    def fail(self, message: str) -> None:
        self._dispatch(EngineFailed(message))

    async def _emit(self, arrived: RequestArrived) -> None:
        ids = self._output_ids(arrived)
        params = arrived.sampling
        if self.hold is not None:
            await self.hold.wait()
        if params.prompt_logprobs is not None:
            await asyncio.sleep(self.prompt_delay_s)
            for report in fake_prompt_logprobs(arrived.req_id, arrived.prompt_token_ids, params.prompt_logprobs):
                self._dispatch(TokensEmitted(arrived.req_id, [], prompt_logprobs=report))
        for index, token_id in enumerate(ids):
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = index == len(ids) - 1
            is_eos = token_id == self.eos_token_id
            logprobs = None
            if params.logprobs is not None:
                top_ids = [token_id, (token_id + 1) % 100][: params.logprobs]
                chosen, second = self.logprob_values
                logprobs = [TokenLogprobs(chosen, top_ids, [chosen, second][: len(top_ids)])]
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


def fake_prompt_logprobs(req_id: str, prompt: list[int], k: int) -> list[PromptLogprobs]:
    """Position p: logprob -p / 10, rank p + 1; top j (0-based): token prompt[p] + j for odd p (so the
    prompt token is the top one), else prompt[p] + 1 + j, mod 256, with logprob -(j + 1) / 100. Two
    chunks, split in the middle of the prompt."""
    positions = list(range(1, len(prompt)))
    reports = []
    for chunk in (positions[: len(positions) // 2], positions[len(positions) // 2 :]):
        if not chunk:
            continue
        tops = [[(prompt[p] + (p % 2 == 0) + j) % 256 for j in range(k)] for p in chunk] if k else []
        values = [[-(j + 1) / 100 for j in range(k)] for _ in chunk] if k else []
        reports.append(PromptLogprobs(req_id, chunk[0], [-p / 10 for p in chunk], [p + 1 for p in chunk], tops, values))
    return reports
