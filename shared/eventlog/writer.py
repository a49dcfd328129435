"""Appends events to a new run; `seq` is assigned here, from 1.

fsync policy (`EngineConfig.event_log_fsync`), applied by `commit()`, which the shell calls
once per handled input, after that input's records:
    never   flush to the OS only
    step    fsync when the records committed include a StepPlan: at most one per step
    always  fsync at every commit
Segments rotate when the next record would take the current one past `max_bytes`.
Any OSError becomes LogWriteError and leaves the writer broken: every later call raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, BinaryIO

from shared.eventlog.format import RECORD_HEAD, LogWriteError, encode_header, encode_record, record_hash
from shared.eventlog.names import next_log_name, parse_name, segment_file_name

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
        opener: Opener = open,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync policy must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.fsync_policy = fsync
        self.max_bytes = max_bytes
        self._config_json = config_json
        self._opener = opener
        self._seq = 0
        self._prev_hash = 0
        self._broken: LogWriteError | None = None
        self._closed = False
        first = next_log_name(directory, run_id)
        name = parse_name(first)
        if name is None:
            raise ValueError(f"bad log name {first!r}")
        self._number, self._run_id = name.number, name.run_id or None
        self.path = os.path.join(directory, first)  # the run's first segment
        self.segment_paths: list[str] = []
        self._file: BinaryIO = self._open_segment(1)

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
        """End of one input's records: flush, and fsync as the policy says."""
        policy = self.fsync_policy
        self.flush(fsync=policy == "always" or (policy == "step" and step_planned))

    def flush(self, fsync: bool = False) -> None:
        self._check_usable()
        self._guard("flush", self._file.flush)
        if fsync:
            self._guard("fsync", lambda: os.fsync(self._file.fileno()))

    def close(self) -> None:
        if self._closed:
            return
        try:
            if self._broken is None:
                self.flush(fsync=self.fsync_policy != "never")
        finally:
            self._closed = True
            try:
                self._file.close()
            except OSError:
                pass  # already reported, or nothing left to lose

    def __enter__(self) -> "EventLogWriter":
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
        path = os.path.join(self.directory, segment_file_name(self._number, self._run_id, segment))
        self.segment_paths.append(path)
        header = encode_header(self._config_json)
        try:
            f = self._opener(path, "xb")
        except OSError as exc:
            self._broken = LogWriteError(path, "create", exc)
            raise self._broken from exc
        self._file = f
        self._guard("write", lambda: f.write(header))
        self._size = self._header_size = len(header)
        return f

    def _rotate(self) -> None:
        sync = self.fsync_policy != "never"
        self.flush(fsync=sync)
        self._guard("close", self._file.close)
        self._file = self._open_segment(len(self.segment_paths) + 1)
        if sync:
            self._guard("flush", self._file.flush)
            self._guard("fsync", lambda: os.fsync(self._file.fileno()))
            self._guard("fsync of the directory", self._sync_directory)

    def _sync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
