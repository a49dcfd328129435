"""`--diff OTHER_LOG`: the first place two logs differ.

Two runs of one workload are compared on their *decision* streams (every record the core
made, in order; inputs and shell-only records are skipped), by bytes: that is what a user
diffing runs wants, and wall-clock fields (RequestArrived.arrival_time_s) live only in
inputs, so they never show up. The first differing input, wall-clock fields zeroed, is
reported beside it for context; it does not decide the outcome. Logs written with
`--event-log-content hashed` compare their digests by pattern (pseudonyms.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgspec

from ledgerserve.scheduler_proc.replay.format import differing_fields, side_by_side
from ledgerserve.scheduler_proc.replay.pseudonyms import renamer
from ledgerserve.scheduler_proc.replay.verify import (
    DECISION,
    INPUT,
    KIND_BY_TAG,
    decode_event,
    require_whole_run,
    same_in_current_format,
    tag_of,
)
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import RunScanner


@dataclass(frozen=True)
class Side:
    seq: int | None  # None: this log has no more records of the kind
    event: Any | None


@dataclass(frozen=True)
class LogDiff:
    paths: tuple[str, str]
    config_differs: bool
    decision: tuple[Side, Side] | None  # the first differing decisions, None: same
    input: tuple[Side, Side] | None  # the first differing inputs (wall clock ignored)

    @property
    def same(self) -> bool:
        return self.decision is None

    def describe(self) -> list[str]:
        lines = ["note: the logs' engine configs differ"] if self.config_differs else []
        if self.decision is None:
            return lines + [f"no decision differs: {self.paths[0]} and {self.paths[1]}"]
        a, b = self.decision
        lines.append(f"first differing decision: seq {a.seq} in {self.paths[0]}, seq {b.seq} in {self.paths[1]}")
        lines += side_by_side(a.event, b.event, "this log", "other log")
        if self.input is not None:
            a, b = self.input
            lines.append(f"first differing input: seq {a.seq} here, seq {b.seq} in the other log")
            lines += side_by_side(a.event, b.event, "this log", "other log")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "paths": list(self.paths),
            "same": self.same,
            "config_differs": self.config_differs,
            "first_decision": _pair_json(self.decision),
            "first_input": _pair_json(self.input),
        }


def diff_logs(path: str, other: str) -> LogDiff:
    left, right = RunScanner(path), RunScanner(other)
    require_whole_run(left)  # a trimmed run's decisions do not line up with a whole one's
    require_whole_run(right)
    decision = _first_difference(_records(left, DECISION), _records(right, DECISION))
    inputs = _first_difference(_records(left, INPUT), _records(right, INPUT))
    return LogDiff((left.path, right.path), left.config_json != right.config_json, decision, inputs)


def _records(scanner: RunScanner, kind: int) -> Iterator[tuple[int, bytes]]:
    rename = renamer(scanner.config_json)  # a hashed log's digests, by their pattern (pseudonyms.py)
    for seq, raw in scanner:
        data = bytes(raw)
        if KIND_BY_TAG.get(tag_of(data), DECISION) == kind:
            data = _without_wall_clock(data) if kind == INPUT else data
            yield seq, data if rename is None else rename(data)


def _without_wall_clock(data: bytes) -> bytes:
    event = decode_event(data)
    if isinstance(event, ev.RequestArrived):
        return codec.encode(msgspec.structs.replace(event, arrival_time_s=0.0))
    return data


def _first_difference(
    left: Iterator[tuple[int, bytes]], right: Iterator[tuple[int, bytes]]
) -> tuple[Side, Side] | None:
    while True:
        a, b = next(left, None), next(right, None)
        if a is None and b is None:
            return None
        if a is None or b is None or (a[1] != b[1] and not same_in_current_format(a[1], b[1])):
            return _side(a), _side(b)


def _side(record: tuple[int, bytes] | None) -> Side:
    return Side(None, None) if record is None else Side(record[0], decode_event(record[1]))


def _pair_json(pair: tuple[Side, Side] | None) -> dict[str, Any] | None:
    if pair is None:
        return None
    a, b = pair
    return {
        "this": {"seq": a.seq, "type": _type(a.event), "event": msgspec.to_builtins(a.event)},
        "other": {"seq": b.seq, "type": _type(b.event), "event": msgspec.to_builtins(b.event)},
        "differing_fields": differing_fields(a.event, b.event),
    }


def _type(event: Any) -> str | None:
    return type(event).__name__ if event is not None else None
