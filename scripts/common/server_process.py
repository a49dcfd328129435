"""Start the real process group (`ledgerserve serve`) as a child process and inspect it: its
health, its /metrics, whether it is idle and holds nothing. Shared by the HTTP tests and the
benchmarks that start their own server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from scripts.serving.load_test import read_metrics, wait_idle

START_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    model_dir: str | None
    log_dir: str
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    output_path: str = ""
    start_timeout_s: float = START_TIMEOUT_S

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Server:
        args = [sys.executable, "-m", "ledgerserve", "serve"]
        args += [self.model_dir] if self.model_dir else []
        args += ["--port", str(self.port), "--event-log-dir", self.log_dir, *self.extra_args]
        self.output_path = os.path.join(self.log_dir, f"server-{self.port}.out")
        os.makedirs(self.log_dir, exist_ok=True)
        out = open(self.output_path, "wb")
        self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **self.env})
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy in {self.start_timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        with open(self.output_path, errors="replace") as f:
            return f.read()

    def children(self) -> list[Any]:
        import psutil

        return psutil.Process(self.proc.pid).children(recursive=True)

    def run_dirs(self) -> list[str]:
        """The launcher's ipc run directory, found from a child's --config argument."""
        dirs = []
        for child in self.children():
            cmd = child.cmdline()
            if "--config" in cmd:
                dirs.append(os.path.dirname(cmd[cmd.index("--config") + 1]))
        return sorted(set(dirs))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout_s)

    def metrics(self) -> dict[str, float]:
        return read_metrics(self.base_url)

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, float]:
        """Until the engine is idle and holds nothing (scripts/serving/load_test.py's `leaks`): no
        request running or waiting, every KV block free or cached, no pins, no deferrals."""
        m, found = wait_idle(self.base_url, timeout_s)
        if found:
            raise TimeoutError(f"engine not idle: {found}: {m}")
        return m
