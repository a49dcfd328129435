"""Appends events to a new run; `seq` is assigned here, from 1.

fsync policy (`EngineConfig.event_log_fsync`), applied by `commit()`, which the shell calls
once per handled input, after that input's records:
    never   flush to the OS only
    step    with `group_commit` (the scheduler): flush, and have a thread fsync in the background
            (group_commit.py), one fsync at a time covering every record flushed before it began;
            `durable_seq` says how far the records are synced. Without it: fsync when the records
            committed include a StepPlan, at most one per step
    always  fsync at every commit
Segments rotate when the next record would take the current one past `max_bytes`;
`on_rotate` (retention) is called between closing one segment and opening the next.
Each segment is flock'ed while it is written, so retention elsewhere can tell a live run; it is
created 0600 in a directory made 0700 (private.py).
Any OSError becomes LogWriteError and leaves the writer broken: every later call raises.
A run broken before any record reached its file (a start on a full disk) is removed on
close, so it does not hide the runs before it.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from typing import Any, BinaryIO

from ledgerserve.shared.eventlog.format import (
    RECORD_HEAD,
    LogWriteError,
    SegmentInfo,
    encode_header,
    encode_record,
    record_hash,
)
from ledgerserve.shared.eventlog.group_commit import Syncer
from ledgerserve.shared.eventlog.names import next_log_name, parse_name, segment_file_name
from ledgerserve.shared.eventlog.private import make_private_dir, open_private

FSYNC_POLICIES = ("never", "step", "always")
Opener = Callable[[str, str], BinaryIO]


class EventLogWriter:
    def __init__(
        self,
        directory: str,
        config_json: bytes,
        run_id: str | None = None,
        *,
        fsync: str = "step",
        max_bytes: int | None = None,
        opener: Opener = open_private,
        on_rotate: Callable[[], None] | None = None,
        group_commit: bool = False,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        make_private_dir(directory)
        self.directory = directory
        self.fsync_policy = fsync
        self.max_bytes = max_bytes
        self._config_json = config_json
        self._opener = opener
        self._on_rotate = on_rotate
        self._seq = 0
        self._prev_hash = 0
        self._size = self._header_size = 0
        self._broken: LogWriteError | None = None
        self._closed = False
        self.last_fsynced = False  # whether the last commit synced (the serving-path profile reads it)
        first = next_log_name(directory, run_id)
        name = parse_name(first)
        if name is None:
            raise ValueError(f"bad log name {first!r}")
        self._number, self._run_id = name.number, name.run_id
        self.path = os.path.join(directory, first)  # the run's first segment
        self.segment_paths: list[str] = []
        self._syncer: Syncer | None = None
        self._file: BinaryIO = self._open_segment(1)
        if group_commit and fsync == "step":
            self._syncer = Syncer(self._file.fileno(), 0, self._size)

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def current_path(self) -> str:
        return self.segment_paths[-1]

    def append(self, event: Any, encoded: bytes | None = None) -> int:
        """Log `event`; `encoded` is its codec.encode bytes if the caller has them already."""
        self._check_usable()
        record = encode_record(self._seq + 1, self._prev_hash, event, encoded)
        if self.max_bytes is not None and self._size > self._header_size and self._size + len(record) > self.max_bytes:
            self._rotate()
        self._guard("write", lambda: self._file.write(record))
        self._size += len(record)
        self._seq += 1
        self._prev_hash = record_hash(record[RECORD_HEAD.size :])
        return self._seq

    def commit(self, step_planned: bool) -> None:
        """End of one input's records: flush, and fsync as the policy says (or ask the syncer to)."""
        policy = self.fsync_policy
        if self._syncer is not None:
            self.last_fsynced = False
            self.flush()
            self.check_synced()
            self._syncer.request(self._seq, self._size)
            return
        self.last_fsynced = policy == "always" or (policy == "step" and step_planned)
        self.flush(fsync=self.last_fsynced)

    @property
    def durable_seq(self) -> int:
        """The records up to this seq are as durable as the policy makes them: synced by the group
        commit; without one, everything committed."""
        if self._syncer is None or (self._closed and self._broken is None):  # close synced what was left
            return self._seq
        return self._syncer.durable_seq

    @property
    def wake_fd(self) -> int | None:
        """Readable when a group-commit fsync ended (then call `check_synced`); None without one."""
        return self._syncer.wake_fd if self._syncer is not None else None

    def check_synced(self) -> list[tuple[int, int, int]]:
        """The group-commit fsyncs that ended since the last call (seq, start ns, end ns); a failed
        one breaks the writer (LogWriteError)."""
        self._check_usable()
        if self._syncer is None:
            return []
        done = self._syncer.take_done()
        if self._syncer.error is not None:
            self._broken = LogWriteError(self.current_path, "fsync", self._syncer.error)
            raise self._broken
        return done

    def flush(self, fsync: bool = False) -> None:
        self._check_usable()
        self._guard("flush", self._file.flush)
        if fsync:
            self._guard("fsync", lambda: os.fsync(self._file.fileno()))

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._syncer is not None:
                self._syncer.pause()
            if self._broken is None:
                self.flush(fsync=self.fsync_policy != "never")
        finally:
            if self._syncer is not None:
                self._syncer.close()
            self._closed = True
            try:
                self._file.close()
            except OSError:
                pass  # already reported, or nothing left to lose
            if self._broken is not None:
                self._remove_if_empty()

    def __enter__(self) -> EventLogWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closed:
            raise ValueError(f"event log {self.path} is closed")

    def _guard(self, action: str, op: Callable[[], object]) -> None:
        try:
            op()
        except OSError as exc:
            self._broken = LogWriteError(self.current_path, action, exc)
            raise self._broken from exc

    def _open_segment(self, segment: int) -> BinaryIO:
        path = os.path.join(self.directory, segment_file_name(self._number, self._run_id or None, segment))
        self.segment_paths.append(path)
        header = encode_header(
            self._config_json, SegmentInfo(self._number, self._run_id, segment, self._seq + 1, self._prev_hash)
        )
        try:
            f = self._opener(path, "xb")
        except OSError as exc:
            self._broken = LogWriteError(path, "create", exc)
            raise self._broken from exc
        self._file = f
        _lock(f)
        self._size = self._header_size = len(header)
        try:
            self._guard("write", lambda: f.write(header))
        except LogWriteError:
            self.close()  # a first segment left without its header is removed
            raise
        return f

    def _remove_if_empty(self) -> None:
        """A run that broke before any record reached its only segment holds nothing to
        replay: remove it (best effort: the disk may refuse that too)."""
        if len(self.segment_paths) != 1:
            return
        try:
            if os.path.getsize(self.path) <= self._header_size:
                os.remove(self.path)
        except OSError:
            pass

    def _rotate(self) -> None:
        sync = self.fsync_policy != "never"
        if self._syncer is not None:
            self._syncer.pause()
        self.flush(fsync=sync)
        self._guard("close", self._file.close)
        if self._on_rotate is not None:
            self._on_rotate()
        self._file = self._open_segment(len(self.segment_paths) + 1)
        if sync:
            self._guard("flush", self._file.flush)
            self._guard("fsync", lambda: os.fsync(self._file.fileno()))
            self._guard("fsync of the directory", self._sync_directory)
        if self._syncer is not None:
            self._syncer.resume(self._file.fileno(), self._seq, self._size)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _lock(f: BinaryIO) -> None:
    """flock the segment being written; the lock goes with the file's close (or the process)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except (AttributeError, OSError, ValueError):
        pass  # a file object without a descriptor, or a filesystem without flock
