"""ZeroMQ sockets over `ipc://` in a private run directory. Never TCP, never pickle."""

from __future__ import annotations

import os
import tempfile

import msgspec
import zmq

CONTROL = "control"  # children -> launcher: ready handshakes
SCHED_IN = "sched_in"  # tokenizer -> scheduler
SCHED_FROM_WORKERS = "sched_from_workers"  # workers -> scheduler
TO_TOKENIZER = "to_tokenizer"  # scheduler -> tokenizer
DEATH_NOTICE = "death_notice"  # launcher -> tokenizer (then SIGUSR1) and scheduler (then SIGTERM): who died


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


class DeathNotice(msgspec.Struct, frozen=True):
    """A child of the launcher died: which one, its exit status, and the message for clients."""

    process: str  # "scheduler", "worker-<rank>" or "tokenizer"
    exit_code: int  # as the launcher saw it; negative: killed by that signal
    message: str


def write_death_notice(run_dir: str, notice: DeathNotice) -> None:
    """Atomically write the notice the tokenizer reads on SIGUSR1 and the scheduler when it
    closes its log (see process_group)."""
    path = os.path.join(run_dir, DEATH_NOTICE)
    with open(path + ".tmp", "wb") as f:
        f.write(msgspec.json.encode(notice))
    os.replace(path + ".tmp", path)


def read_death_notice(run_dir: str) -> DeathNotice | None:
    """The notice, or None when there is none (no child died) or it cannot be read."""
    try:
        with open(os.path.join(run_dir, DEATH_NOTICE), "rb") as f:
            return msgspec.json.decode(f.read(), type=DeathNotice)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None
