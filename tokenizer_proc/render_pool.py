"""Chat-template renders in worker processes, so the render time limit holds for any template.

jinja2 compiles a template to Python: a loop that writes nothing, or one huge arithmetic
operation, never returns to a place where a time check could run, and a thread cannot be
stopped. A worker process can: each render is sent to an idle worker (render_worker.py), and a
worker that has not answered by the deadline is killed (a fresh one starts on the next render).
Workers run in a pool of NUM_WORKERS; a pool thread per render waits on its worker's pipe, so
the event loop never waits. The workers also end themselves: a render that outlives its deadline
by WORKER_GRACE_S ends the process (SIGALRM, its default action), memory is capped at
WORKER_MEMORY_BYTES, and a worker whose parent is gone sees the end of its input and exits.

Frames on the pipes are a 4-byte big-endian length and msgpack (msgspec); nothing is pickled.
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

import ledgerserve

NUM_WORKERS = min(4, os.cpu_count() or 1)
WORKER_START_S = 60.0  # the longest wait for a new worker to import and compile the template
WORKER_GRACE_S = 1.0  # past its deadline, a worker still rendering ends itself
WORKER_MEMORY_BYTES = 4 << 30  # address space of one worker
PACKAGE_ROOT = str(Path(ledgerserve.__file__).resolve().parents[1])  # the directory `ledgerserve` is imported from


class RenderSetup(msgspec.Struct, array_like=True):
    source: str
    bos_token: str
    eos_token: str


class RenderRequest(msgspec.Struct, array_like=True):
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    extra: dict[str, Any]
    max_chars: int
    max_seconds: float


class RenderReply(msgspec.Struct, array_like=True, omit_defaults=True):
    text: str = ""
    error: str | None = None  # the ChatTemplateError's message


class RenderFailed(Exception):
    """A render that gave no text: the template's error, the deadline, or the worker's death."""


def write_frame(stream: BinaryIO, payload: bytes) -> None:
    stream.write(len(payload).to_bytes(4, "big") + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame, or None at the end of the stream."""
    head = stream.read(4)
    if len(head) < 4:
        return None
    payload = stream.read(int.from_bytes(head, "big"))
    return payload if len(payload) == int.from_bytes(head, "big") else None


class Worker:
    """One render process and its pipes; used by one pool thread at a time."""

    def __init__(self, setup: bytes) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ledgerserve.tokenizer_proc.render_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=PACKAGE_ROOT,  # `-m` imports from the working directory first: this process's ledgerserve
        )
        write_frame(self.proc.stdin, setup)
        if self._read(time.monotonic() + WORKER_START_S) is None:
            self.kill()
            raise RuntimeError("the chat template renderer did not start")  # the server's fault: a 500

    def ask(self, request: bytes, timeout_s: float) -> bytes | None:
        """The reply to `request`, or None if none came within `timeout_s` (the worker is killed)."""
        try:
            write_frame(self.proc.stdin, request)
        except OSError:
            self.kill()
            return None
        reply = self._read(time.monotonic() + timeout_s)
        if reply is None:
            self.kill()
        return reply

    def _read(self, deadline: float) -> bytes | None:
        head = self._read_exactly(4, deadline)
        return None if head is None else self._read_exactly(int.from_bytes(head, "big"), deadline)

    def _read_exactly(self, size: int, deadline: float) -> bytes | None:
        fd, parts, left = self.proc.stdout.fileno(), [], size
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            part = os.read(fd, min(left, 1 << 20))
            if not part:
                return None  # the worker died
            parts.append(part)
            left -= len(part)
        return b"".join(parts)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


@dataclass
class _Workers:
    idle: list[Worker] = field(default_factory=list)
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class RenderPool:
    """Up to `num_workers` render processes, started as renders need them."""

    def __init__(self, setup: RenderSetup, num_workers: int = NUM_WORKERS) -> None:
        self._setup = msgspec.msgpack.encode(setup)
        self._threads = ThreadPoolExecutor(num_workers, thread_name_prefix="chat-template")
        self._workers = _Workers()
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._threads)

    async def render(self, request: RenderRequest) -> str:
        """The rendered text; RenderFailed saying why there is none."""
        try:
            payload = msgspec.msgpack.encode(request)
        except (TypeError, OverflowError) as exc:  # e.g. an integer of more than 64 bits
            raise RenderFailed(f"the chat cannot be rendered: {exc}") from None
        loop = asyncio.get_running_loop()
        reply = await loop.run_in_executor(self._threads, self._render, payload, request.max_seconds)
        if reply.error is not None:
            raise RenderFailed(reply.error)
        return reply.text

    def _render(self, payload: bytes, max_seconds: float) -> RenderReply:
        """On a pool thread: an idle worker (or a new one) renders, or is killed at the deadline."""
        workers = self._workers
        with workers.lock:
            worker = workers.idle.pop() if workers.idle else None
        if worker is None:
            worker = Worker(self._setup)
        raw = worker.ask(payload, max_seconds)
        if raw is None:
            if worker.proc.returncode != -signal.SIGKILL:
                raise RenderFailed(f"the chat template renderer stopped (exit status {worker.proc.returncode})")
            raise RenderFailed(f"rendering the chat template took longer than {max_seconds:g} s")
        with workers.lock:
            if workers.closed:
                worker.kill()
            else:
                workers.idle.append(worker)
        return msgspec.msgpack.decode(raw, type=RenderReply)

    def close(self) -> None:
        self._finalizer()


def _stop(workers: _Workers, threads: ThreadPoolExecutor) -> None:
    threads.shutdown(wait=False, cancel_futures=True)
    with workers.lock:
        workers.closed = True
        idle, workers.idle = workers.idle, []
    for worker in idle:
        worker.kill()
