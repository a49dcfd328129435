"""`--diff OTHER_LOG`: the first place two logs differ.

Two runs of one workload are compared on their *decision* streams (every record the core
made, in order; inputs and shell-only records are skipped), by bytes: that is what a user
diffing runs wants, and wall-clock fields (RequestArrived.arrival_time_s, a load's duration)
live only in inputs, so they never show up. The first differing client input (a request, an
abort, an adapter op: the traffic; the workers' reports interleave with it as their timing goes),
its arrival time zeroed, is reported beside it for context; it does not decide the outcome. Logs
written with `--event-log-content hashed` compare their digests by pattern (pseudonyms.py).

Engine configs are compared field by field, and each differing field is named with both values.
Fields that differ between any two runs by nature are left out: where a run lives and listens
(`PER_RUN_FIELDS`: its ipc run directory, its event-log directory, its host and port). A config
difference is a note; it never decides the outcome either.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

import msgspec

from ledgerserve.scheduler_proc.replay.format import differing_fields, side_by_side
from ledgerserve.scheduler_proc.replay.pseudonyms import renamer
from ledgerserve.scheduler_proc.replay.verify import (
    DECISION,
    INPUT,
    KIND_BY_TAG,
    decode_event,
    not_an_event,
    require_whole_run,
    same_in_current_format,
    tag_of,
)
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import LogCorruption, RunScanner

PER_RUN_FIELDS = ("run_dir", "event_log_dir", "host", "port")


@dataclass(frozen=True)
class ConfigField:
    name: str
    this: Any
    other: Any


@dataclass(frozen=True)
class Side:
    seq: int | None  # None: this log has no more records of the kind
    event: Any | None


@dataclass(frozen=True)
class LogDiff:
    paths: tuple[str, str]
    decision: tuple[Side, Side] | None  # the first differing decisions, None: same
    input: tuple[Side, Side] | None  # the first differing inputs (wall clock ignored)
    config: list[ConfigField] = field(default_factory=list)  # engine-config fields that differ (not per-run ones)

    @property
    def config_differs(self) -> bool:
        return bool(self.config)

    @property
    def same(self) -> bool:
        return self.decision is None

    def describe(self) -> list[str]:
        lines = [f"note: the logs' engine configs differ in {len(self.config)} field(s):"] if self.config else []
        lines += [f"  {c.name}: {c.this!r} in this log, {c.other!r} in the other log" for c in self.config]
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
            "config_differences": [{"field": c.name, "this": c.this, "other": c.other} for c in self.config],
            "first_decision": _pair_json(self.decision),
            "first_input": _pair_json(self.input),
        }


def diff_logs(path: str, other: str) -> LogDiff:
    left, right = RunScanner(path), RunScanner(other)
    require_whole_run(left)  # a trimmed run's decisions do not line up with a whole one's
    require_whole_run(right)
    decision = _first_difference(_records(left, DECISION), _records(right, DECISION))
    inputs = _first_difference(_records(left, INPUT), _records(right, INPUT))
    return LogDiff((left.path, right.path), decision, inputs, config_differences(left.config_json, right.config_json))


def config_differences(config_json: bytes, other_json: bytes) -> list[ConfigField]:
    """The engine-config fields whose values differ, in the first config's order (then fields only
    the other has), but PER_RUN_FIELDS. A config that is not a JSON object is one whole difference."""
    this, other = _json_object(config_json), _json_object(other_json)
    if this is None or other is None:
        return [] if config_json == other_json else [ConfigField("(config)", this, other)]
    names = list(this) + [name for name in other if name not in this]
    missing = "(absent)"
    return [
        ConfigField(name, this.get(name, missing), other.get(name, missing))
        for name in names
        if name not in PER_RUN_FIELDS and this.get(name, missing) != other.get(name, missing)
    ]


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


_Record = tuple[int, bytes, tuple[str, int]]  # seq, the event's bytes, (segment, offset)


_CLIENT_TAGS = frozenset(cls.__name__.encode() for cls in get_args(ev.ToScheduler))


def _records(scanner: RunScanner, kind: int) -> Iterator[_Record]:
    """The decisions, or the client's inputs (not the workers' reports)."""
    rename = _renamer(scanner)  # a hashed log's digests, by their pattern (pseudonyms.py)
    for seq, raw in scanner:
        data = bytes(raw)
        tag = tag_of(data)
        if (tag in _CLIENT_TAGS) if kind == INPUT else KIND_BY_TAG.get(tag, DECISION) == kind:
            yield seq, _comparable(data, kind, rename, scanner), scanner.position


def _renamer(scanner: RunScanner) -> Callable[[bytes], bytes] | None:
    try:
        return renamer(scanner.config_json)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, TypeError) as exc:
        raise LogCorruption(f"the header's engine config is not valid: {exc}", None, 0, scanner.path) from None


def _comparable(data: bytes, kind: int, rename: Callable[[bytes], bytes] | None, scanner: RunScanner) -> bytes:
    """What is compared of a record: an input without its wall-clock fields; a hashed log's
    digests renamed."""
    try:
        data = _without_wall_clock(data) if kind == INPUT else data
        return data if rename is None else rename(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise not_an_event(scanner, exc) from None


def _without_wall_clock(data: bytes) -> bytes:
    event = decode_event(data)
    if isinstance(event, ev.RequestArrived):
        return codec.encode(msgspec.structs.replace(event, arrival_time_s=0.0))
    return data


def _first_difference(left: Iterator[_Record], right: Iterator[_Record]) -> tuple[Side, Side] | None:
    while True:
        a, b = next(left, None), next(right, None)
        if a is None and b is None:
            return None
        if a is None or b is None or (a[1] != b[1] and not same_in_current_format(a[1], b[1])):
            return _side(a), _side(b)


def _side(record: _Record | None) -> Side:
    if record is None:
        return Side(None, None)
    seq, data, (path, offset) = record
    try:
        return Side(seq, decode_event(data))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise LogCorruption(f"record holds no readable event: {exc}", seq, offset, path) from None


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
