"""Retention: keep a log directory within `--event-log-max-total-bytes`.

The bound covers every segment file in the directory (`events-N-ID[+K].log`; set-aside
`.torn-*` files and other files are not counted) plus `reserve_bytes`, the room the segment
being written may still take (its writer's `max_bytes`), so the directory stays within the
bound until the next rotation. While over it, the oldest files go first:

1. whole runs other than the writer's own, oldest first; a run whose newest segment another
   writer holds (flock: an engine sharing the directory) is never touched;
2. then the oldest segments of the writer's own run (the run becomes *trimmed*: replay
   reports it), never its newest segment, the one being written.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass

from ledgerserve.shared.eventlog.names import SegmentName, parse_name, segments_in

RunKey = tuple[int, str]  # (run number, run id)


@dataclass(frozen=True)
class LogFile:
    name: SegmentName
    path: str
    num_bytes: int

    @property
    def run(self) -> RunKey:
        return (self.name.number, self.name.run_id)


def plan_removals(
    files: list[LogFile], protected_path: str, max_total_bytes: int, reserve_bytes: int, live_runs: set[RunKey]
) -> list[LogFile]:
    """The files to remove, in order, so that what is left plus `reserve_bytes` fits in
    `max_total_bytes` (or as close as allowed). `protected_path` is the segment being written."""
    total = sum(f.num_bytes for f in files) + reserve_bytes
    removals: list[LogFile] = []
    for group in _removal_order(files, protected_path, live_runs):
        if total <= max_total_bytes:
            break
        removals += group
        total -= sum(f.num_bytes for f in group)
    return removals


def _removal_order(files: list[LogFile], protected_path: str, live_runs: set[RunKey]) -> list[list[LogFile]]:
    """Other runs whole, oldest first; then the own run's segments one by one, oldest first."""
    own_run = _run_of(protected_path)
    runs: dict[RunKey, list[LogFile]] = {}
    for f in sorted(files, key=lambda f: f.name):
        runs.setdefault(f.run, []).append(f)
    groups = [runs[key] for key in sorted(runs) if key != own_run and key not in live_runs]
    own = runs.get(own_run, []) if own_run is not None else []
    return groups + [[f] for f in own if f.path != protected_path]


def enforce_retention(
    directory: str, max_total_bytes: int, protected_path: str, reserve_bytes: int
) -> tuple[list[str], int]:
    """Remove the oldest log files of `directory` past the bound. Returns the removed paths
    and the bytes of log files left (over the bound only if nothing more may go). Raises
    OSError if the directory cannot be read or a file cannot be removed."""
    files = _log_files(directory)
    num_bytes = sum(f.num_bytes for f in files)
    if num_bytes + reserve_bytes <= max_total_bytes:
        return [], num_bytes
    own_run = _run_of(protected_path)
    newest: dict[RunKey, str] = {f.run: f.path for f in sorted(files, key=lambda f: f.name)}
    live = {run for run, path in sorted(newest.items()) if run != own_run and _is_held(path)}
    removed: list[str] = []
    for f in plan_removals(files, protected_path, max_total_bytes, reserve_bytes, live):
        try:
            os.remove(f.path)
            removed.append(f.path)
        except FileNotFoundError:
            pass  # gone already
        num_bytes -= f.num_bytes
    return removed, num_bytes


def _run_of(path: str) -> RunKey | None:
    parsed = parse_name(os.path.basename(path))
    return (parsed.number, parsed.run_id) if parsed is not None else None


def _log_files(directory: str) -> list[LogFile]:
    out: list[LogFile] = []
    for name, path in segments_in(directory):
        try:
            out.append(LogFile(name, path, os.path.getsize(path)))
        except FileNotFoundError:
            continue
    return out


def _is_held(path: str) -> bool:
    """Whether a writer holds `path` (its flock), i.e. the run is being written."""
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except OSError:
        return False
    return False
