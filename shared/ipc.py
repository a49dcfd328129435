"""ZeroMQ sockets over `ipc://` in a private run directory. Never TCP, never pickle."""

from __future__ import annotations

import os
import tempfile

import zmq

CONTROL = "control"  # children -> launcher: ready handshakes
SCHED_IN = "sched_in"  # tokenizer -> scheduler
SCHED_FROM_WORKERS = "sched_from_workers"  # workers -> scheduler
TO_TOKENIZER = "to_tokenizer"  # scheduler -> tokenizer
ENGINE_DEAD_NOTICE = "engine_dead"  # launcher -> tokenizer: a file naming the dead process, then SIGUSR1


def make_run_dir() -> str:
    """A fresh directory only this user can enter (mkdtemp creates it 0700)."""
    path = tempfile.mkdtemp(prefix="ledgerserve-")
    os.chmod(path, 0o700)
    return path


def address(run_dir: str, name: str) -> str:
    return f"ipc://{os.path.join(run_dir, name + '.sock')}"


def to_worker(rank: int) -> str:
    return f"to_worker_{rank}"


def bind(ctx: zmq.Context, kind: int, run_dir: str, name: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address(run_dir, name))
    return sock


def connect(ctx: zmq.Context, kind: int, run_dir: str, name: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address(run_dir, name))
    return sock


def write_engine_dead_notice(run_dir: str, message: str) -> None:
    """Atomically write the notice the tokenizer reads on SIGUSR1 (see process_group)."""
    path = os.path.join(run_dir, ENGINE_DEAD_NOTICE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(message)
    os.replace(path + ".tmp", path)


def read_engine_dead_notice(run_dir: str) -> str:
    try:
        with open(os.path.join(run_dir, ENGINE_DEAD_NOTICE), encoding="utf-8") as f:
            return f.read().strip() or "an engine process died"
    except OSError:
        return "an engine process died"
