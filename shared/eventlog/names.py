"""Log file names. A run is one or more segments in one directory:

    events-000007-<run_id>.log            segment 1
    events-000007-<run_id>+000002.log     segment 2, 3, ... (after rotation)

Runs are numbered; a new run takes one more than the highest number in the directory.
Retention (retention.py) may remove a run's first segments: the run then starts at its
first remaining segment, and is *trimmed*.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass

from ledgerserve.shared.eventlog.format import header_end, is_cut_header, read_header_bytes

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


def segments_in(directory: str) -> list[tuple[SegmentName, str]]:
    """Every log segment in `directory` with its parsed name, oldest run first, then by segment."""
    found = [(parse_name(name), name) for name in os.listdir(directory)]
    return sorted((parsed, os.path.join(directory, name)) for parsed, name in found if parsed is not None)


def list_logs(directory: str) -> list[str]:
    """The first remaining segment of each run in `directory` (segment 1 unless the run was
    trimmed), oldest run first."""
    firsts: dict[tuple[int, str], str] = {}
    for parsed, path in segments_in(directory):
        firsts.setdefault((parsed.number, parsed.run_id), path)
    return [firsts[key] for key in sorted(firsts)]


def newest_log(directory: str) -> str:
    """The newest run's first remaining segment, passing over runs that hold no record (a
    start that failed leaves one: 0 bytes, a cut header or a header alone), with a warning."""
    runs: dict[tuple[int, str], list[tuple[SegmentName, str]]] = {}
    for parsed, path in segments_in(directory):
        runs.setdefault((parsed.number, parsed.run_id), []).append((parsed, path))
    for key in sorted(runs, reverse=True):
        segments = runs[key]
        if _is_empty_run(segments):
            warnings.warn(
                f"{segments[0][1]}: skipped: a run without records, left by a start that failed", stacklevel=2
            )
            continue
        return segments[0][1]
    raise FileNotFoundError(f"no events-*.log file with a run in {directory}")


def _is_empty_run(segments: list[tuple[SegmentName, str]]) -> bool:
    """Only segment 1, and no record in it: a cut header (0 bytes included) or a header alone."""
    if len(segments) != 1 or segments[0][0].segment != 1:
        return False
    path = segments[0][1]
    head = read_header_bytes(path)
    if is_cut_header(head):
        return True
    end = header_end(head)
    return end is not None and os.path.getsize(path) <= end


def run_segments(path: str) -> list[str]:
    """Every remaining segment of the run that `path` (a log file, any segment, or a
    directory: its newest run) belongs to, in order. Segments missing before the first one
    found (a trimmed run) are no error; a gap after it raises FileNotFoundError."""
    if os.path.isdir(path):
        path = newest_log(path)
    directory = os.path.dirname(path) or "."
    me = parse_name(os.path.basename(path))
    if me is None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"no such event log: {path}")
        return [path]  # a log under another name: read it alone
    mine = [(p.segment, full) for p, full in segments_in(directory) if (p.number, p.run_id) == (me.number, me.run_id)]
    if not mine:
        raise FileNotFoundError(f"no such event log: {path}")
    for expected, (segment, full) in enumerate(mine, start=mine[0][0]):
        if segment != expected:
            raise FileNotFoundError(
                f"segment {expected} of the run of {path} is missing (found {os.path.basename(full)})"
            )
    return [full for _, full in mine]


def next_log_name(directory: str, run_id: str | None) -> str:
    """Segment 1 of a new run, numbered one more than the highest number in `directory`."""
    if run_id is not None and not _RUN_ID.match(run_id):
        raise ValueError(f"run id must match {_RUN_ID.pattern}, got {run_id!r}")
    numbers = [p.number for p, _ in segments_in(directory)]
    return segment_file_name(max(numbers, default=0) + 1, run_id, 1)
