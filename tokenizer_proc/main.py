"""Process entry: `python -m tokenizer_proc.main --config PATH_TO_CONFIG_JSON`.

Loads the tokenizer, connects to the scheduler, serves HTTP with uvicorn (uvloop), and
tells the launcher it is ready once the HTTP socket listens. SIGTERM: uvicorn stops
accepting and lets in-flight requests finish (up to shutdown_timeout_s). Exits if the
launcher (its parent) goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from typing import Any, Iterator

import msgspec
import uvicorn
import zmq

from shared import ipc
from shared.config import EngineConfig
from tokenizer_proc.adapter_routes import StartupAdapterError
from tokenizer_proc.app import build_app
from tokenizer_proc.engine_client import EngineClient

logger = logging.getLogger("tokenizer_proc")
PARENT_POLL_S = 0.5


class Server(uvicorn.Server):
    """uvicorn's server, but SIGINT/SIGTERM end in a clean exit (status 0) instead of
    being re-raised after the graceful shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tokenizer_proc.main", description="ledgerserve HTTP/tokenizer process")
    parser.add_argument("--config", required=True, help="path to the EngineConfig JSON in the run directory")
    return parser.parse_args(argv)


def load_config(path: str) -> EngineConfig:
    with open(path, "rb") as f:
        return EngineConfig.from_json(f.read())


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def send_ready(run_dir: str) -> None:
    """Handshake to the launcher: msgpack {"process": "tokenizer", "pid": pid} on CONTROL."""
    ctx = zmq.Context.instance()
    sock = ipc.connect(ctx, zmq.PUSH, run_dir, ipc.CONTROL)
    try:
        sock.setsockopt(zmq.LINGER, 5000)  # let the frame leave before close
        sock.send(msgspec.msgpack.encode({"process": "tokenizer", "pid": os.getpid()}))
    finally:
        sock.close()


async def watch_parent(server: uvicorn.Server, parent_pid: int) -> None:
    """Stop serving if the launcher dies (we get re-parented)."""
    while not server.should_exit:
        if os.getppid() != parent_pid:
            logger.error("launcher (pid %d) is gone; exiting", parent_pid)
            server.should_exit = True
            server.force_exit = True
            return
        await asyncio.sleep(PARENT_POLL_S)


async def announce_when_listening(server: uvicorn.Server, run_dir: str) -> None:
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.02)
    send_ready(run_dir)
    logger.info("tokenizer ready on http://%s:%d", server.config.host, server.config.port)


async def serve(config: EngineConfig, parent_pid: int) -> None:
    tokenizer = load_tokenizer(config.model_dir)
    engine = EngineClient(config.run_dir)
    try:
        app = build_app(engine, tokenizer, config)  # its lifespan starts and closes the engine
    except StartupAdapterError as e:
        raise SystemExit(f"tokenizer: {e}") from None
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="none",  # we already run on uvloop
        lifespan="on",
        log_level="info",
        timeout_graceful_shutdown=config.shutdown_timeout_s,  # type: ignore[arg-type]
    )
    server = Server(uv_config)
    helpers = [
        asyncio.create_task(announce_when_listening(server, config.run_dir)),
        asyncio.create_task(watch_parent(server, parent_pid)),
    ]
    try:
        await server.serve()
    finally:
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
    if not server.started:
        raise SystemExit("tokenizer: HTTP server failed to start (see the log above; a refused "
                         "start-up adapter is named there)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tokenizer %(levelname)s %(message)s")
    config = load_config(args.config)
    if not config.run_dir:
        raise SystemExit("tokenizer: config.run_dir is empty")
    parent_pid = os.getppid()
    import uvloop

    uvloop.run(serve(config, parent_pid))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
