"""Start the real process group (`ledgerserve serve`) for HTTP tests, and inspect it
(`scripts.common.server_process`), and check that a stopped group left nothing behind."""

from __future__ import annotations

import os
import time

import psutil

from scripts.common.server_process import START_TIMEOUT_S, Server

__all__ = ["START_TIMEOUT_S", "Server", "assert_all_gone"]


def assert_all_gone(pids: list[int], run_dirs: list[str], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        left = [d for d in run_dirs if os.path.exists(d)]
        if not alive and not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"left behind: processes {alive}, run dirs {left}")
