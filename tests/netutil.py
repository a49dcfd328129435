"""Loopback helpers shared by the tests that run a real HTTP server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from scripts.common.server_process import free_port

__all__ = ["free_port", "serve_in_thread"]


@contextmanager
def serve_in_thread(app, port: int, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Run `app` under uvicorn on 127.0.0.1:`port` in a daemon thread; yield its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
