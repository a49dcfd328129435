"""`EngineClient`: the engine client over ZeroMQ (PUSH to the scheduler's SCHED_IN, PULL from
TO_TOKENIZER; both connect). What it sends and how it routes what it reads: engine_client.py."""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from ledgerserve.shared import codec, ipc, spans
from ledgerserve.shared.events import Event, TokensEmitted
from ledgerserve.tokenizer_proc import staging
from ledgerserve.tokenizer_proc.engine_client import EngineClientBase

logger = logging.getLogger(__name__)

MAX_FRAMES_PER_WAKE = 1024


class EngineClient(EngineClientBase):
    """PUSH to the scheduler's SCHED_IN, PULL from TO_TOKENIZER; both connect."""

    def __init__(self, run_dir: str, context: zmq.asyncio.Context | None = None) -> None:
        super().__init__()
        self._ctx = context or zmq.asyncio.Context.instance()
        self._push = ipc.connect(self._ctx, zmq.PUSH, run_dir, ipc.SCHED_IN)
        self._pull = ipc.connect(self._ctx, zmq.PULL, run_dir, ipc.TO_TOKENIZER)
        self._decoder = codec.from_scheduler_decoder()
        self._reader: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._push.close(linger=0)
        self._pull.close(linger=0)

    async def wait_staged(self, names: list[str], max_cpu_loras: int) -> None:
        await staging.wait_staged(self.adapter_rows, names, max_cpu_loras)

    async def _send(self, event: Event) -> None:
        await self._push.send(codec.encode(event))

    async def _read_loop(self) -> None:
        """Each wake-up takes every message already queued (up to MAX_FRAMES_PER_WAKE frames): a step's
        outputs for many requests cost one turn of the event loop, not one each. A message is the
        frames one log sync released (scheduler_proc/outbox.py), so one receive takes them all."""
        while True:
            frames = await self._pull.recv_multipart()
            recv_ns = spans.now_ns()
            while len(frames) < MAX_FRAMES_PER_WAKE:
                try:
                    frames += await self._pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            if self.spans is not None:
                self.spans.batch_recv_ns = recv_ns
            num_tokens = 0
            for frame in frames:
                try:
                    event = self._decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self.num_bad_frames += 1
                    logger.warning("dropped an undecodable frame (%d so far)", self.num_bad_frames)
                    continue
                num_tokens += len(event.new_token_ids) if isinstance(event, TokensEmitted) else 0
                self._dispatch(event)
            if self.spans is not None:
                self.spans.batch(recv_ns, len(frames), num_tokens)
