"""Re-feed a log's inputs into a fresh core and check every logged decision against it.

Speed: records are checked by the scanner without decoding the event; only inputs are
decoded (the tag is peeked from the msgpack bytes), and a logged decision is compared by
bytes with the core's freshly encoded one. Only when the bytes differ is the logged decision
decoded and compared as a value: a struct that gained a trailing field since the log was
written encodes one more (default) item, and the same decision must still verify.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.core.policy import Policy
from ledgerserve.scheduler_proc.replay.format import differing_fields, side_by_side
from ledgerserve.scheduler_proc.views.adapter_stats import AdapterStats
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import LogCorruption, RunScanner

INPUT, DECISION, SHELL_ONLY = 0, 1, 2
_SHELL_ONLY_TYPES = (ev.LogClosed, ev.Shutdown)  # logged by the shell, never by the core
KIND_BY_TAG: dict[bytes, int] = {cls.__name__.encode(): INPUT for cls in ev.INPUT_TYPES}
KIND_BY_TAG.update({cls.__name__.encode(): SHELL_ONLY for cls in _SHELL_ONLY_TYPES})
_input_decoder = msgspec.msgpack.Decoder(ev.CoreInput)
_log_decoder = codec.log_event_decoder()


def tag_of(data: bytes) -> bytes:
    """The class-name tag of an encoded event: an array whose first item is a str (b"" if it is
    not one; decoding it then says what is wrong)."""
    if len(data) < 2:
        return b""
    first = data[0]
    start = 1 if 0x90 <= first <= 0x9F else 3 if first == 0xDC else 5
    head = data[start] if start < len(data) else 0
    if 0xA0 <= head <= 0xBF:
        return data[start + 1 : start + 1 + (head & 0x1F)]
    if head == 0xD9 and start + 1 < len(data):
        return data[start + 2 : start + 2 + data[start + 1]]
    return b""


def not_an_event(scanner: RunScanner, exc: BaseException) -> LogCorruption:
    """The record the scanner yielded last holds no event this build can read."""
    path, offset = scanner.position
    return LogCorruption(f"record holds no readable event: {exc}", scanner.last_seq, offset, path)


def decode_event(data: bytes) -> Any:
    return _log_decoder.decode(data)


def same_in_current_format(data: bytes, other: bytes) -> bool:
    """Whether two encoded events are the same once read with today's structs and written again
    (a record written before a field was added at the end lacks it; decoded, it has its default)."""
    try:
        return codec.encode(decode_event(data)) == codec.encode(decode_event(other))
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False


@dataclass(frozen=True)
class Divergence:
    seq: int  # the logged record that disagrees (or the next input, when one is missing)
    input_seq: int  # the input whose decisions disagree
    logged: Any | None
    recomputed: Any | None

    def describe(self) -> str:
        lines = [f"divergence at seq {self.seq} (decisions of input seq {self.input_seq}):"]
        lines += side_by_side(self.logged, self.recomputed)
        lines.append(f"  differing fields: {', '.join(differing_fields(self.logged, self.recomputed))}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "input_seq": self.input_seq,
            "logged": msgspec.to_builtins(self.logged) if self.logged is not None else None,
            "logged_type": type(self.logged).__name__ if self.logged is not None else None,
            "recomputed": msgspec.to_builtins(self.recomputed) if self.recomputed is not None else None,
            "recomputed_type": type(self.recomputed).__name__ if self.recomputed is not None else None,
            "differing_fields": differing_fields(self.logged, self.recomputed),
        }


class HistoryTrimmed(Exception):
    """The run's first segments are gone: the core cannot be rebuilt without the start of
    the run, so nothing after it can be verified or shown."""

    def __init__(self, scanner: RunScanner, last_seq: int) -> None:
        gone = "segment 1" if scanner.first_segment == 2 else f"segments 1-{scanner.first_segment - 1}"
        super().__init__(
            f"{scanner.path}: the run's history is trimmed: its {gone} (seq 1-{scanner.first_seq - 1}) are gone, "
            f"removed by retention (--event-log-max-total-bytes) or by hand. The records left, seq "
            f"{scanner.first_seq}-{last_seq} in {len(scanner.segments)} segment(s), are intact, but replay rebuilds "
            f"the scheduler from the start of the run: without it nothing can be verified or shown"
        )
        self.path = scanner.path
        self.first_segment = scanner.first_segment
        self.first_seq = scanner.first_seq
        self.last_seq = last_seq


def require_whole_run(scanner: RunScanner) -> None:
    """Raise HistoryTrimmed for a trimmed run, after checking what is left of it (a damaged
    record still raises LogCorruption)."""
    if not scanner.is_trimmed:
        return
    last_seq = scanner.first_seq - 1
    for seq, _ in scanner:
        last_seq = seq
    raise HistoryTrimmed(scanner, last_seq)


def core_config(scanner: RunScanner) -> CoreConfig:
    """The core as the run's engine had it: the header's engine config, with the behaviour of the
    header's schema version (core/policy.py says what each older schema's engine did)."""
    policy = Policy.for_schema(scanner.header.schema_version)
    try:
        return CoreConfig.from_engine(EngineConfig.from_json(scanner.config_json), policy)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, TypeError) as exc:
        raise LogCorruption(f"the header's engine config is not valid: {exc}", None, 0, scanner.path) from None


@dataclass
class ReplayResult:
    path: str
    core: Core
    segments: list[str] = field(default_factory=list)
    num_records: int = 0
    num_inputs: int = 0
    num_decisions: int = 0  # logged decisions checked against the core
    last_seq: int = 0  # the last record the replay took in
    divergence: Divergence | None = None
    truncated_tail: bool = False  # the log ends before the last input's decisions
    torn_tail: tuple[str, int] | None = None  # a dropped torn record: (segment, offset)
    closed: ev.LogClosed | None = None  # the log's closing record, if the replay reached one
    adapter_stats: AdapterStats | None = None  # the logged records taken in, folded (with_adapter_stats)
    tp_layout: str = ""  # how the run's model was split over its ranks (the header's config; "": one rank)

    @property
    def ok(self) -> bool:
        return self.divergence is None


def replay(
    path: str,
    verify: bool = True,
    until_seq: int | None = None,
    until_step: int | None = None,
    with_adapter_stats: bool = False,
) -> ReplayResult:
    """Raises LogCorruption for a damaged log (FileNotFoundError for a missing one) and
    HistoryTrimmed for a run whose start is gone; returns at the first divergence, after
    record `until_seq`, or before the first input once the core has planned step
    `until_step`. Read-only: a torn tail is skipped, not cut off. `with_adapter_stats`: fold
    the logged records taken in into per-adapter figures, as the scheduler did for /metrics."""
    scanner = RunScanner(path, repair=False)
    require_whole_run(scanner)
    config = core_config(scanner)
    core = Core(config)
    result = ReplayResult(scanner.path, core, scanner.segments)
    result.tp_layout = EngineConfig.from_json(scanner.config_json).tp_layout
    if with_adapter_stats:
        result.adapter_stats = AdapterStats(config.tensor_parallel_size, config.lora_overlap_loading, keep_waits=True)
    try:
        _run(scanner, result, verify, until_seq, until_step)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise not_an_event(scanner, exc) from None
    result.torn_tail = scanner.torn_tail
    return result


def _run(
    scanner: RunScanner, result: ReplayResult, verify: bool, until_seq: int | None, until_step: int | None
) -> None:
    core = result.core
    kinds = KIND_BY_TAG
    encode = codec.encode
    decode_input = _input_decoder.decode
    pending: list[bytes] = []
    made: list[Any] = []
    index = num_inputs = num_decisions = input_seq = 0
    last = 0
    reached_end = False
    for seq, raw in scanner:
        if until_seq is not None and seq > until_seq:
            break
        data = bytes(raw)
        kind = kinds.get(tag_of(data), DECISION)
        if kind == INPUT:
            if verify and index < len(pending):
                result.divergence = Divergence(seq, input_seq, None, made[index])
                break
            if until_step is not None and core.step >= until_step:
                break
            event = decode_input(data)
            made = _apply(core, event, scanner)
            pending = [encode(d) for d in made] if verify else []
            index, input_seq = 0, seq
            num_inputs += 1
            _fold(result.adapter_stats, event, scanner)
        elif kind == SHELL_ONLY and tag_of(data) == b"LogClosed":
            result.closed = decode_event(data)
        elif kind == DECISION and verify:
            if index >= len(pending) or (pending[index] != data and decode_event(data) != made[index]):
                recomputed = made[index] if index < len(pending) else None
                result.divergence = Divergence(seq, input_seq, decode_event(data), recomputed)
                break
            index += 1
            num_decisions += 1
            _fold(result.adapter_stats, made[index - 1], scanner)
        elif kind == DECISION and result.adapter_stats is not None:
            _fold(result.adapter_stats, decode_event(data), scanner)
        last = seq
    else:
        reached_end = True
    result.num_inputs, result.num_decisions, result.last_seq = num_inputs, num_decisions, last
    result.num_records = last
    result.truncated_tail = reached_end and verify and index < len(pending)


def _apply(core: Core, event: Any, scanner: RunScanner) -> list[Any]:
    """The core's decisions for a logged input. An input the core cannot take at all (it raises:
    a crafted or damaged log, or a fault in the core) stops the replay as a damaged log."""
    try:
        return core.apply(event)
    except Exception as exc:
        path, offset = scanner.position
        message = f"the scheduler core cannot apply this {type(event).__name__}: {type(exc).__name__}: {exc}"
        raise LogCorruption(message, scanner.last_seq, offset, path) from None


def _fold(stats: AdapterStats | None, event: Any, scanner: RunScanner) -> None:
    """A verified decision is folded as recomputed: the same value as the logged one. One the
    figures cannot take (a crafted or damaged log) stops the replay as a damaged log."""
    if stats is None:
        return
    try:
        stats.fold(event)
    except Exception as exc:
        path, offset = scanner.position
        message = f"the adapter figures cannot take this {type(event).__name__}: {type(exc).__name__}: {exc}"
        raise LogCorruption(message, scanner.last_seq, offset, path) from None
