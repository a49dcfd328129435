"""Process entry: `python -m tokenizer_proc.main --config PATH_TO_CONFIG_JSON`.

Loads the tokenizer, connects to the scheduler, serves HTTP with uvicorn (uvloop), and
tells the launcher it is ready once the HTTP socket listens. SIGTERM: drain (503 for
/health and new requests, in-flight ones finish, up to shutdown_timeout_s), then exit 0.
SIGUSR1: an engine process died; fail in-flight requests. If the launcher (its parent)
dies, in-flight requests fail the same way, get a moment to flush, and the process exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import uvicorn
import zmq

from ledgerserve.shared import ipc, spans
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.proc import PARENT_GONE_EXIT, exit_with_parent
from ledgerserve.tokenizer_proc.adapter_routes import StartupAdapterError
from ledgerserve.tokenizer_proc.app import build_app
from ledgerserve.tokenizer_proc.connections import (
    KEEP_ALIVE_S,
    GuardedHttpToolsProtocol,
    connection_cap,
    raise_fd_limit,
)
from ledgerserve.tokenizer_proc.engine_socket import EngineClient
from ledgerserve.tokenizer_proc.request_spans import RequestSpans
from ledgerserve.tokenizer_proc.security import StartupRefused

logger = logging.getLogger("tokenizer_proc")
DRAIN_POLL_S = 0.05
FLUSH_S = 0.4  # after the launcher died: the longest wait for in-flight requests to send their error


class Server(uvicorn.Server):
    """uvicorn's server, with the signals ledgerserve needs:

    - SIGTERM/SIGINT: drain. /health and new requests get 503 at once while the socket
      stays open; in-flight requests finish (up to `drain_timeout_s`); then uvicorn's
      graceful shutdown and a clean exit (status 0). Requests still running at the
      timeout are cut. A second signal ends the wait at once.
    - SIGUSR1: the launcher saw an engine process die (its notice file names it): every
      in-flight request fails with EngineDeadError and /health turns 503.
    - the launcher's death (`on_launcher_gone`): the same failure, a moment to flush, exit.
    """

    def __init__(self, config: uvicorn.Config, engine: EngineClient, run_dir: str, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.run_dir = run_dir
        self.drain_timeout_s = drain_timeout_s
        self._drain_task: asyncio.Task[None] | None = None
        self.launcher_gone = False

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        loop.add_signal_handler(signal.SIGUSR1, self.on_engine_dead)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                loop.remove_signal_handler(sig)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain_task is not None or not self.started:
            super().handle_exit(sig, frame)
            return
        logger.info("received %s: draining %d in-flight requests", signal.Signals(sig).name, self.engine.num_in_flight)
        self.engine.is_draining = True
        self._drain_task = asyncio.get_running_loop().create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.engine.num_in_flight and self.engine.is_healthy and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.engine.num_in_flight and self.engine.is_healthy:
            logger.warning("shutdown timeout: cutting %d in-flight requests", self.engine.num_in_flight)
            self.force_exit = True
        super().handle_exit(sig, None)

    def on_engine_dead(self) -> None:
        notice = ipc.read_death_notice(self.run_dir)
        self.engine.engine_died(notice.message if notice is not None else "an engine process died")

    def on_launcher_gone(self, reason: str) -> None:
        """Fail every in-flight request (a stream gets an error event, then [DONE]; a plain
        request a 503), give the responses a moment to leave, then exit."""
        logger.error("%s: failing %d in-flight requests, then exiting", reason, self.engine.num_in_flight)
        self.launcher_gone = True
        self.engine.engine_died(reason)
        asyncio.get_running_loop().create_task(self._exit_after_flush())

    async def _exit_after_flush(self) -> None:
        """Until every request handler has sent its response (at most FLUSH_S), then
        uvicorn's shutdown, which closes the connections."""
        deadline = time.monotonic() + FLUSH_S
        await asyncio.sleep(DRAIN_POLL_S)
        while (self.engine.num_in_flight or self.server_state.tasks) and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        self.should_exit = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ledgerserve.tokenizer_proc.main", description="ledgerserve HTTP/tokenizer process"
    )
    parser.add_argument("--config", required=True, help="path to the EngineConfig JSON in the run directory")
    listen = "a socket the launcher bound for HTTP (repeatable); serve on these instead of binding host:port"
    parser.add_argument("--listen-fd", type=int, action="append", default=[], help=listen)
    return parser.parse_args(argv)


def load_config(path: str) -> EngineConfig:
    with open(path, "rb") as f:
        return EngineConfig.from_json(f.read())


GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")  # what AutoTokenizer maps them to


def load_tokenizer(tokenizer_dir: str) -> Any:
    """AutoTokenizer's tokenizer for the directory. One whose tokenizer_config.json names the
    generic fast class (Llama 3's, the demo model's) is built by that class directly: the same
    tokenizer, without AutoTokenizer's import of every model config, and through them of torch,
    seconds of start-up this process does not need."""
    if _declared_class(tokenizer_dir) in GENERIC_FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _declared_class(tokenizer_dir: str) -> str | None:
    """tokenizer_config.json's tokenizer_class, if the file is there and says one."""
    try:
        with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    name = value.get("tokenizer_class") if isinstance(value, dict) else None
    return name if isinstance(name, str) else None


def send_ready(run_dir: str) -> None:
    """Handshake to the launcher: msgpack {"process": "tokenizer", "pid": pid} on CONTROL."""
    ctx = zmq.Context.instance()
    sock = ipc.connect(ctx, zmq.PUSH, run_dir, ipc.CONTROL)
    try:
        sock.setsockopt(zmq.LINGER, 5000)  # let the frame leave before close
        sock.send(msgspec.msgpack.encode({"process": "tokenizer", "pid": os.getpid()}))
    finally:
        sock.close()


async def announce_when_listening(server: uvicorn.Server, run_dir: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    send_ready(run_dir)
    scheme = "https" if server.config.is_ssl else "http"
    logger.info("tokenizer ready on %s://%s:%d", scheme, server.config.host, server.config.port)


def uvicorn_config(app: Any, config: EngineConfig) -> uvicorn.Config:
    """uvicorn's settings: the bind address, log level, root path (behind a proxy) and TLS; the
    HTTP protocol closes silent connections and caps their number (connections.py)."""
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="none",  # we already run on uvloop
        http=GuardedHttpToolsProtocol,
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="on",
        log_level=config.uvicorn_log_level,
        timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
        root_path=config.root_path,
        ssl_keyfile=config.ssl_keyfile or None,
        ssl_certfile=config.ssl_certfile or None,
    )


async def serve(config: EngineConfig, listen_fds: list[int] | None = None) -> None:
    tokenizer = load_tokenizer(config.tokenizer_dir)
    engine = EngineClient(config.run_dir)
    if (writer := spans.open_writer(config.profile_dir, "http")) is not None:
        engine.spans = RequestSpans(writer)
    try:
        app = build_app(engine, tokenizer, config)  # its lifespan starts and closes the engine
    except (StartupAdapterError, StartupRefused) as e:
        raise SystemExit(f"tokenizer: {e}") from None
    uv_config = uvicorn_config(app, config)
    server = Server(uv_config, engine, config.run_dir, config.shutdown_timeout_s)
    loop = asyncio.get_running_loop()

    def launcher_gone(reason: str) -> bool:  # on the parent-watch thread
        loop.call_soon_threadsafe(server.on_launcher_gone, reason)
        return True

    exit_with_parent(config.run_dir, launcher_gone)
    helpers = [asyncio.create_task(announce_when_listening(server, config.run_dir))]
    sockets = [socket.socket(fileno=fd) for fd in listen_fds] if listen_fds else None
    try:
        await server.serve(sockets=sockets)
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        if engine.spans is not None:
            engine.spans.close()
    if server.launcher_gone:  # nobody waits for this process: skip the interpreter's teardown (a second or more)
        os._exit(PARENT_GONE_EXIT)
    if not server.started:
        raise SystemExit(
            "tokenizer: HTTP server failed to start (see the log above; a refused start-up adapter is named there)"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tokenizer %(levelname)s %(message)s")
    config = load_config(args.config)
    if not config.run_dir:
        raise SystemExit("tokenizer: config.run_dir is empty")
    logger.info("open-file limit %d: at most %d connections", raise_fd_limit(), connection_cap())
    import uvloop

    uvloop.run(serve(config, args.listen_fd))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
