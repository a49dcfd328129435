"""What every child process does the same way: read its config, announce readiness to
the launcher, and exit when the launcher is gone."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import threading
import time

import msgspec
import zmq

from shared import ipc
from shared.config import EngineConfig

PARENT_POLL_S = 0.5


def child_args(argv: list[str] | None = None, with_rank: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True, help="path of the engine config JSON")
    if with_rank:
        parser.add_argument("--rank", type=int, default=0)
    return parser.parse_args(argv)


def load_config(path: str) -> EngineConfig:
    with open(path, "rb") as f:
        return EngineConfig.from_json(f.read())


def setup_logging(name: str) -> logging.Logger:
    logging.basicConfig(
        level=os.environ.get("LEDGERSERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
    return logging.getLogger(name)


def send_ready(run_dir: str, process: str) -> None:
    """Tell the launcher this process is ready (one msgpack map on the control socket)."""
    ctx = zmq.Context.instance()
    sock = ipc.connect(ctx, zmq.PUSH, run_dir, ipc.CONTROL)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.send(msgspec.msgpack.encode({"process": process, "pid": os.getpid()}))
    sock.close()


def exit_with_parent(run_dir: str | None = None) -> None:
    """Start a daemon thread that ends this process when its parent (the launcher) dies,
    first removing the launcher's run directory (`run_dir`), which nobody else will."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        if run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
