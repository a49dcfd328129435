"""Log file names. A run is one or more segments in one directory:

    events-000007-<run_id>.log            segment 1
    events-000007-<run_id>+000002.log     segment 2, 3, ... (after rotation)

Runs are numbered; a new run takes one more than the highest number in the directory.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_LOG_NAME = re.compile(r"^events-(\d{6,})(?:-([A-Za-z0-9._-]+))?(?:\+(\d{6,}))?\.log$")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True, order=True)
class SegmentName:
    number: int
    run_id: str
    segment: int  # from 1


def parse_name(name: str) -> SegmentName | None:
    match = _LOG_NAME.match(name)
    if match is None:
        return None
    return SegmentName(int(match.group(1)), match.group(2) or "", int(match.group(3) or 1))


def segment_file_name(number: int, run_id: str | None, segment: int) -> str:
    base = f"events-{number:06d}" + (f"-{run_id}" if run_id else "")
    return f"{base}.log" if segment == 1 else f"{base}+{segment:06d}.log"


def log_number(name: str) -> int | None:
    parsed = parse_name(name)
    return parsed.number if parsed else None


def _segments(directory: str) -> list[tuple[SegmentName, str]]:
    found = [(parse_name(name), name) for name in os.listdir(directory)]
    return sorted((parsed, os.path.join(directory, name)) for parsed, name in found if parsed is not None)


def list_logs(directory: str) -> list[str]:
    """The first segment of each run in `directory`, oldest run first."""
    return [path for parsed, path in _segments(directory) if parsed.segment == 1]


def newest_log(directory: str) -> str:
    logs = list_logs(directory)
    if not logs:
        raise FileNotFoundError(f"no events-*.log file in {directory}")
    return logs[-1]


def run_segments(path: str) -> list[str]:
    """Every segment of the run that `path` (a log file, any segment, or a directory: its
    newest run) belongs to, in order. A gap in the segment numbers raises FileNotFoundError."""
    if os.path.isdir(path):
        path = newest_log(path)
    directory = os.path.dirname(path) or "."
    me = parse_name(os.path.basename(path))
    if me is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such event log: {path}")
        return [path]  # a log under another name: read it alone
    mine = [(p.segment, full) for p, full in _segments(directory) if (p.number, p.run_id) == (me.number, me.run_id)]
    for expected, (segment, full) in enumerate(mine, start=1):
        if segment != expected:
            raise FileNotFoundError(f"segment {expected} of the run of {path} is missing (found {os.path.basename(full)})")
    if not mine:
        raise FileNotFoundError(f"no such event log: {path}")
    return [full for _, full in mine]


def next_log_name(directory: str, run_id: str | None) -> str:
    """Segment 1 of a new run, numbered one more than the highest number in `directory`."""
    if run_id is not None and not _RUN_ID.match(run_id):
        raise ValueError(f"run id must match {_RUN_ID.pattern}, got {run_id!r}")
    numbers = [p.number for p, _ in _segments(directory)]
    return segment_file_name(max(numbers, default=0) + 1, run_id, 1)
