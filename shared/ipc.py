"""ZeroMQ sockets over `ipc://` in a private run directory. Never TCP, never pickle."""

from __future__ import annotations

import os
import tempfile

import zmq

CONTROL = "control"  # children -> launcher: ready handshakes
SCHED_IN = "sched_in"  # tokenizer -> scheduler
SCHED_FROM_WORKERS = "sched_from_workers"  # workers -> scheduler
TO_TOKENIZER = "to_tokenizer"  # scheduler -> tokenizer


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
