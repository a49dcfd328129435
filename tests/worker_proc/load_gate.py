"""Holding chosen adapter reads on the loader threads, so overlapped-loading tests decide when
each load's disk read ends; and polling a runner until the replies a test waits for arrive."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ledgerserve.shared.events import Event
from ledgerserve.worker_proc.lora import loader


class ReadGate:
    """Stands in for loader.read_image: reads of a held path wait until it is released."""

    def __init__(self) -> None:
        self.real = loader.read_image
        self.held: dict[str, threading.Event] = {}
        self.thread_names: list[str] = []

    def hold(self, path: str) -> threading.Event:
        self.held[path] = threading.Event()
        return self.held[path]

    def release(self, path: str) -> None:
        self.held[path].set()

    def __call__(self, spec, pool, version_id: int, path: str, content_sha256: str, progress=None):
        self.thread_names.append(threading.current_thread().name)
        gate = self.held.get(path)
        if gate is not None and not gate.wait(60):
            raise TimeoutError(f"the read of {path} was never released")
        return self.real(spec, pool, version_id, path, content_sha256, progress)


def poll_until(runner, done: Callable[[list[Event]], bool], timeout_s: float = 60.0) -> list[Event]:
    """The replies runner.adapters.poll gave until `done(replies)` holds."""
    replies: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while not done(replies):
        assert time.monotonic() < deadline, f"still waiting; got {replies}"
        replies += runner.adapters.poll()
        time.sleep(0.001)
    return replies


def settle(runner, timeout_s: float = 60.0) -> list[Event]:
    """Poll until no load is under way; the replies that came."""
    replies: list[Event] = []
    deadline = time.monotonic() + timeout_s
    while runner.adapters.busy():
        assert time.monotonic() < deadline, f"loads still busy; got {replies}"
        replies += runner.adapters.poll()
        time.sleep(0.001)
    return replies + runner.adapters.poll()
