"""An in-process engine for the HTTP tests: the real scheduler core (ledgerserve.engine) driving a
fake runner that needs no model. The runner echoes each request's prompt tokens back (or `script`),
one per step; it reports prompt logprobs for the prompt positions each step computes
(fake_prompt_logprobs) and finishes adapter loads at once. Adapter ops, rejections, finish reasons
and cached tokens are the core's own.

Built on EngineClientBase, so the per-request queues and dispatch are the real ones; only the
transport is replaced: one task takes the events in the order they were sent, applies each to the
engine, and steps it while it has work. Records every event it receives, for assertions.
"""

from __future__ import annotations

import asyncio
from typing import Any

from ledgerserve.engine import Engine
from ledgerserve.scheduler_proc.ledger import TO_TOKENIZER_TYPES
from ledgerserve.scheduler_proc.views.registry_changes import registry_changes
from ledgerserve.shared import codec
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.events import (
    AdapterInfo,
    AdapterLoadCompleted,
    AdapterLoadRequested,
    AdapterPrefetched,
    AdapterSlotAssigned,
    AdapterUnloadRequested,
    Event,
    PromptLogprobs,
    RankDigest,
    RequestAborted,
    RequestArrived,
    SampledToken,
    StepCompleted,
    StepPlan,
    TokenLogprobs,
    WorkerFailed,
    WorkerReady,
)
from ledgerserve.shared.sampling import SamplingParams
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase

HELD_POLL_S = 0.001  # how often a held engine looks at `hold` again


class EchoRunner:
    """A worker rank with no model: request i's output token j is its prompt's token j (cycled),
    or `script`'s. Keeps each request's known tokens as a worker does, and samples where a plan's
    scheduled tokens reach their end."""

    def __init__(self, num_kv_blocks: int) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.script: list[int] | None = None
        self.logprob_values = (-0.25, -1.5)  # the sampled token's logprob, and the second top one's
        self.tokens: dict[str, list[int]] = {}
        self.reqs: dict[str, tuple[int, SamplingParams]] = {}  # req id -> (num_prompt_tokens, sampling)

    def ready(self) -> WorkerReady:
        return WorkerReady(0, self.num_kv_blocks, 1 << 16, [], "cpu", "float32")  # no EOS: only length ends

    def execute(self, plan: StepPlan) -> tuple[StepCompleted, RankDigest]:
        for req_id in [*plan.finished_req_ids, *plan.preempted_req_ids]:
            self.tokens.pop(req_id, None)
        for new in plan.new_reqs:
            self.tokens[new.req_id] = list(new.token_ids)
            self.reqs[new.req_id] = (new.num_prompt_tokens, new.sampling)
        for cached in plan.cached_reqs:
            self.tokens[cached.req_id] += cached.new_token_ids
        sampled, reports = [], []
        for req in [*plan.new_reqs, *plan.cached_reqs]:
            tokens, (num_prompt, sampling) = self.tokens[req.req_id], self.reqs[req.req_id]
            end = req.num_computed_tokens + req.num_scheduled_tokens
            positions = list(range(req.num_computed_tokens + 1, min(end, num_prompt - 1) + 1))
            if sampling.prompt_logprobs is not None and positions:
                reports.append(fake_prompt_logprobs(req.req_id, tokens, positions, sampling.prompt_logprobs))
            if end == len(tokens):
                sampled.append(self._sample(req.req_id, tokens, num_prompt, sampling.logprobs))
        return StepCompleted(plan.step, 0, sampled, [], reports), RankDigest(plan.step, 0, 0)

    def _sample(self, req_id: str, tokens: list[int], num_prompt: int, num_logprobs: int | None) -> SampledToken:
        source = self.script or tokens[:num_prompt]
        token_id = source[(len(tokens) - num_prompt) % len(source)]
        if num_logprobs is None:
            return SampledToken(req_id, token_id)
        top_ids = [token_id, (token_id + 1) % 100][:num_logprobs]
        chosen, second = self.logprob_values
        return SampledToken(req_id, token_id, TokenLogprobs(chosen, top_ids, [chosen, second][: len(top_ids)]))

    @property
    def adapters(self) -> EchoRunner:
        """The runner carries out its adapter commands itself."""
        return self

    def command(self, cmd: Event, arrival_s: float) -> list[Event]:
        if isinstance(cmd, AdapterSlotAssigned):
            return [AdapterLoadCompleted(0, cmd.slot, cmd.version_id, "disk")]
        if isinstance(cmd, AdapterPrefetched):
            return [AdapterLoadCompleted(0, -1, cmd.version_id, "disk")]
        return []  # evictions

    def poll(self) -> list[Event]:
        return []

    def busy(self) -> bool:
        return False


class FakeEngine(EngineClientBase):
    def __init__(
        self, delay_s: float = 0.0, op_delay_s: float = 0.0, num_kv_blocks: int = 1024, **settings: Any
    ) -> None:
        """`settings`: EngineConfig fields of the core (LoRA is on unless they say otherwise)."""
        super().__init__()
        self.delay_s = delay_s  # before each engine step
        self.op_delay_s = op_delay_s  # time the core takes to answer an adapter op
        self.prompt_delay_s = 0.0  # a request asking for prompt logprobs reaches the core this much later
        self.hold: asyncio.Event | None = None  # when set: the engine steps only once it is set
        self.encode_events = False  # encode each event like the real transport (catches overflows)
        self.received: list[Event] = []
        self.runner = EchoRunner(num_kv_blocks)
        settings = {"max_model_len": 4096, "enable_lora": True, **settings}
        config = EngineConfig(model_dir="", served_model_name="fake", **settings)
        self.engine = Engine(config, self.runner)
        self.is_ready = True
        self._inbox: asyncio.Queue[Event] = asyncio.Queue()
        self._pump: asyncio.Task[None] | None = None

    @property
    def script(self) -> list[int] | None:
        return self.runner.script

    @script.setter
    def script(self, token_ids: list[int]) -> None:
        self.runner.script = token_ids

    @property
    def logprob_values(self) -> tuple[float, float]:
        return self.runner.logprob_values

    @logprob_values.setter
    def logprob_values(self, values: tuple[float, float]) -> None:
        self.runner.logprob_values = values

    @property
    def registry(self) -> dict[str, AdapterInfo]:
        """The core's adapter registry: name -> its current version."""
        return {info.name: info for info in self.engine.core.adapters.infos()}

    @property
    def aborts(self) -> list[RequestAborted]:
        return [e for e in self.received if isinstance(e, RequestAborted)]

    @property
    def arrivals(self) -> list[RequestArrived]:
        return [e for e in self.received if isinstance(e, RequestArrived)]

    async def close(self) -> None:
        if self._pump is not None:
            self._pump.cancel()
            await asyncio.gather(self._pump, return_exceptions=True)
            self._pump = None

    def fail(self, message: str) -> None:
        """Rank 0 reports a fault: the core fails the engine."""
        self._deliver_now(WorkerFailed(0, message))

    def unload_unheard(self, name: str) -> None:
        """The core unloads `name` at once; its reply does not reach this process (its mirror has not heard)."""
        self.engine.apply(AdapterUnloadRequested(f"elsewhere-{name}", name))

    async def _send(self, event: Event) -> None:
        if self.encode_events:
            codec.encode(event)
        self.received.append(event)
        self._start_pump()
        if isinstance(event, RequestArrived) and event.sampling.prompt_logprobs is not None and self.prompt_delay_s:
            asyncio.get_running_loop().call_later(self.prompt_delay_s, self._inbox.put_nowait, event)
        else:
            self._inbox.put_nowait(event)

    def _start_pump(self) -> None:
        """One pump, in the running event loop (a client that runs each call in a loop of its own gets a new one)."""
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._inbox = asyncio.Queue()
            self._pump = loop.create_task(self._run(self._inbox))

    async def _run(self, inbox: asyncio.Queue[Event]) -> None:
        """Apply the events in the order they came, and step the engine while it has work (and is not held)."""
        while inbox is self._inbox:
            if inbox.empty() and not self.engine.has_work():
                await self._take(await inbox.get())
            while not inbox.empty():
                await self._take(inbox.get_nowait())
            if not self.engine.has_work():
                continue
            if self.hold is not None and not self.hold.is_set():
                await asyncio.sleep(HELD_POLL_S)
                continue
            await asyncio.sleep(self.delay_s)
            self._dispatch_decisions(self.engine.step())

    async def _take(self, event: Event) -> None:
        if isinstance(event, (AdapterLoadRequested, AdapterUnloadRequested)) and self.op_delay_s:
            await asyncio.sleep(self.op_delay_s)
        self._deliver_now(event)

    def _deliver_now(self, event: Event) -> None:
        self._dispatch_decisions(self.engine.apply(event))

    def _dispatch_decisions(self, decisions: list[Event]) -> None:
        """As the scheduler's shell sends them: what they changed in the adapter registry first."""
        change = registry_changes(self.engine.core.adapters, decisions)
        if change is not None:
            self._dispatch(change)
        for decision in decisions:
            if isinstance(decision, TO_TOKENIZER_TYPES):
                self._dispatch(decision)


def fake_prompt_logprobs(req_id: str, prompt: list[int], positions: list[int], k: int) -> PromptLogprobs:
    """Position p: logprob -p / 10, rank p + 1; top j (0-based): token prompt[p] + j for odd p (so the
    prompt token is the top one), else prompt[p] + 1 + j, mod 256, with logprob -(j + 1) / 100."""
    tops = [[(prompt[p] + (p % 2 == 0) + j) % 256 for j in range(k)] for p in positions] if k else []
    values = [[-(j + 1) / 100 for j in range(k)] for _ in positions] if k else []
    return PromptLogprobs(req_id, positions[0], [-p / 10 for p in positions], [p + 1 for p in positions], tops, values)
