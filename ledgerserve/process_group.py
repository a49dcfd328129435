"""Start, supervise and stop the launcher's children.

Children run in their own process sessions (setsid) so a terminal's Ctrl-C reaches only the launcher,
which then stops them in order: tokenizer first (it drains in-flight requests), then the
scheduler (it closes the event log and tells workers to exit), then the workers.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import msgspec
import zmq

from ledgerserve.shared import env, ipc
from ledgerserve.shared.config import EngineConfig

log = logging.getLogger("launcher")

POLL_S = 0.1
READY_TIMEOUT_S = 900.0
STOP_GRACE_S = 5.0
NOTICE_FLUSH_S = 1.0  # the tokenizer's time to send error chunks after an engine death


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] | None = field(default=None, repr=False)  # None: inherit the launcher's
    pass_fds: tuple[int, ...] = ()  # file descriptors the child inherits (the HTTP process: its sockets)
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> None:
        child_env = env.with_launcher_pid(self.env, os.getpid())
        self.popen = subprocess.Popen(self.argv, env=child_env, start_new_session=True, pass_fds=self.pass_fds)

    def exit_code(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def signal(self, sig: int) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(sig)


class ProcessGroup:
    def __init__(self, config: EngineConfig, children: list[Child]) -> None:
        self.config = config
        self.children = children
        self._stop_signal: int | None = None

    def run(self, started_s: float) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        ctx = zmq.Context.instance()
        control = ipc.bind(ctx, zmq.PULL, self.config.run_dir, ipc.CONTROL)
        try:
            for child in self.children:
                child.start()
            rc = self._wait_ready(control, started_s)
            if rc is None:
                rc = self._supervise()
            return rc
        finally:
            self._kill_all()
            control.close()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._stop_signal is None:
            log.info("received %s: draining", signal.Signals(signum).name)
        self._stop_signal = signum

    def _dead_child(self) -> Child | None:
        """A child that exited, one killed by a signal first: when a rank is killed, the ranks left
        in its group fail their collective and exit too, maybe before the next poll, and the
        one to name is the one that died first."""
        dead = [child for child in self.children if child.exit_code() is not None]
        return min(dead, key=lambda child: child.exit_code() >= 0) if dead else None

    def _wait_ready(self, control: zmq.Socket, started_s: float) -> int | None:
        pending = {child.name for child in self.children}
        while pending:
            if (dead := self._dead_child()) is not None:
                return self._fail(dead)
            if self._stop_signal is not None:
                return 0
            if time.monotonic() - started_s > READY_TIMEOUT_S:
                log.error("start-up timed out waiting for %s", sorted(pending))
                return 1
            if control.poll(int(POLL_S * 1000)):
                msg = _decode_ready(control.recv())
                pending.discard(msg)
        elapsed = time.monotonic() - started_s
        log.info(
            "ready in %.1f s: http://%s:%d/v1 serving %r (run dir %s, event log %s)",
            elapsed,
            self.config.host,
            self.config.port,
            self.config.served_model_name,
            self.config.run_dir,
            self.config.event_log_dir,
        )
        return None

    def _supervise(self) -> int:
        while self._stop_signal is None:
            if (dead := self._dead_child()) is not None:
                return self._fail(dead, notify=True)
            time.sleep(POLL_S)
        return self._drain()

    def _fail(self, dead: Child, notify: bool = False) -> int:
        """Stop the group after `dead` died: write the death notice first (the scheduler names
        `dead` in its log's LogClosed), tell a serving tokenizer (`notify`), then stop the rest."""
        code = dead.exit_code()
        message = f"process {dead.name!r} (pid {dead.popen.pid}) died with exit code {code}; stopping the group"
        log.error(message)
        print(f"ledgerserve: {message}", file=sys.stderr, flush=True)
        notice = ipc.DeathNotice(dead.name, code, f"engine process {dead.name!r} died (exit code {code})")
        try:
            ipc.write_death_notice(self.config.run_dir, notice)
        except OSError as e:
            log.error("could not write the death notice: %s", e)
        if notify and dead.name != "tokenizer":
            self._notify_tokenizer()
        self._stop_in_order()
        return 1

    def _notify_tokenizer(self) -> None:
        """SIGUSR1 tells the serving tokenizer to read the notice and fail every in-flight
        request with a clear error (and turn /health 503); then give it a moment to flush."""
        tokenizer = self._named("tokenizer")
        if tokenizer.exit_code() is not None:
            return
        tokenizer.signal(signal.SIGUSR1)
        time.sleep(NOTICE_FLUSH_S)

    def _drain(self) -> int:
        """Tokenizer first, up to the shutdown timeout; then the rest."""
        tokenizer = self._named("tokenizer")
        tokenizer.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout_s + STOP_GRACE_S
        while tokenizer.exit_code() is None and time.monotonic() < deadline:
            other = next((c for c in self.children if c is not tokenizer and c.exit_code() is not None), None)
            if other is not None:
                return self._fail(other, notify=True)
            time.sleep(POLL_S)
        self._stop_in_order()
        log.info("stopped")
        return 0

    def _stop_in_order(self) -> None:
        for name in ("tokenizer", "scheduler"):
            child = self._named(name)
            child.signal(signal.SIGTERM)
            _wait(child, STOP_GRACE_S)
        for child in self.children:
            child.signal(signal.SIGTERM)
        for child in self.children:
            _wait(child, STOP_GRACE_S)

    def _kill_all(self) -> None:
        for child in self.children:
            child.signal(signal.SIGKILL)
            if child.popen is not None:
                child.popen.wait()

    def _named(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)


def _wait(child: Child, timeout_s: float) -> None:
    if child.popen is None:
        return
    try:
        child.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.signal(signal.SIGKILL)
        child.popen.wait()


def _decode_ready(frame: bytes) -> str:
    try:
        msg = msgspec.msgpack.decode(frame, type=dict[str, str | int])
    except msgspec.DecodeError:
        log.warning("dropped an undecodable control frame")
        return ""
    return str(msg.get("process", ""))
