"""What every child process does the same way: read its config, announce readiness to
the launcher, and exit when the launcher is gone."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from ledgerserve.shared import env, ipc
from ledgerserve.shared.config import EngineConfig

PARENT_POLL_S = 0.05
PARENT_GONE_GRACE_S = 0.8  # a child's time to flush and close once the launcher is gone, before it exits anyway
PARENT_GONE_EXIT = 3  # the exit status of a child that outlived its launcher


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
    logging.basicConfig(level=env.log_level(), format=f"%(asctime)s {name} %(levelname)s %(message)s")
    return logging.getLogger(name)


def send_ready(run_dir: str, process: str) -> None:
    """Tell the launcher this process is ready (one msgpack map on the control socket)."""
    ctx = zmq.Context.instance()
    sock = ipc.connect(ctx, zmq.PUSH, run_dir, ipc.CONTROL)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.send(msgspec.msgpack.encode({"process": process, "pid": os.getpid()}))
    sock.close()


def exit_with_parent(run_dir: str, on_parent_gone: Callable[[str], bool] | None = None) -> None:
    """Start a daemon thread that ends this process within a second of its launcher's death.

    It polls the parent every PARENT_POLL_S; once the launcher is gone it removes the
    launcher's run directory (nobody else will), then calls `on_parent_gone(reason)`. When
    that returns True the process is closing itself (a flush, a log record): it gets
    PARENT_GONE_GRACE_S to do so before the thread ends it; otherwise it ends at once."""
    launcher = _launcher_pid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(PARENT_POLL_S)
        shutil.rmtree(run_dir, ignore_errors=True)
        if _closes_itself(on_parent_gone, f"the launcher (pid {launcher}) died"):
            time.sleep(PARENT_GONE_GRACE_S)
        os._exit(PARENT_GONE_EXIT)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _launcher_pid() -> int:
    """The pid the launcher gave this process (its parent then), so a launcher that died
    before this call is noticed too; the parent's pid for a process started by hand. The
    variable is taken out of the environment so this process's own children never see it."""
    given = env.pop_launcher_pid()
    return int(given) if given.isdigit() else os.getppid()


def _closes_itself(on_parent_gone: Callable[[str], bool] | None, reason: str) -> bool:
    if on_parent_gone is None:
        return False
    try:
        return on_parent_gone(reason)
    except Exception:  # e.g. an event loop already closed: nothing left to flush
        logging.getLogger("parent-watch").exception("could not close after: %s", reason)
        return False
