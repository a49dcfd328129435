"""Reading a run: every record's checksum, seq and chain are checked, across segments.

A run whose first segments were removed (retention) is *trimmed*: it reads from its first
remaining segment, whose header (schema 2) says where the chain stands there.

The run's last segment may end in a torn write: a record cut short, or bytes that are no
whole record (zeros, garbage) with no whole record after them. That tail is dropped with a
warning, and with `repair=True` cut off the file (its bytes are kept aside in
`<segment>.torn-<offset>`). A bad record anywhere else (followed by a whole record, or in an
earlier segment), a broken chain or an undecodable record raises LogCorruption with the
seq and byte offset.
"""

from __future__ import annotations

import os
import struct
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import xxhash

from ledgerserve.shared import codec
from ledgerserve.shared.eventlog.format import (
    MAX_RECORD_BYTES,
    RECORD_HEAD,
    LogCorruption,
    LogHeader,
    SegmentInfo,
    encode_header,
    parse_header,
    read_file,
    read_header_bytes,
)
from ledgerserve.shared.eventlog.names import parse_name, run_segments
from ledgerserve.shared.eventlog.tail import check_bad_record

_envelope_decoder = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])


class RunScanner:
    """Iterates `(seq, raw_event)` over a run's segments: `raw_event` is the event's
    msgpack bytes (msgspec.Raw), checked but not decoded."""

    def __init__(self, path: str, repair: bool = False) -> None:
        self.segments = run_segments(path)
        self.path = self.segments[0]
        self.repair = repair
        self.header = parse_header(read_header_bytes(self.path), self.path)
        self.first_segment = _segment_number(self.path, self.header)  # 1 unless trimmed
        self.torn_tail: tuple[str, int] | None = None  # (segment, offset) of a dropped torn record
        self.position: tuple[str, int] = (self.path, 0)  # (segment, offset) of the record last yielded
        self.last_seq = 0  # the seq of the record last yielded

    @property
    def config_json(self) -> bytes:
        return self.header.config_json

    @property
    def is_trimmed(self) -> bool:
        """The run's first segment is gone: its history before `self.path` is lost."""
        return self.first_segment > 1

    @property
    def first_seq(self) -> int:
        """The seq of the first record read: 1 unless the run is trimmed."""
        return self._chain_start()[0] + 1

    def __iter__(self) -> Iterator[tuple[int, msgspec.Raw]]:
        seq, prev_hash = self._chain_start()
        last = len(self.segments) - 1
        for index, path in enumerate(self.segments):
            data = read_file(path)
            if index == last and index > 0 and self._is_torn_header(data, index, seq, prev_hash):
                self._on_torn_segment(path, data)
                return
            header = parse_header(data, path)
            if header.config_json != self.header.config_json:
                raise LogCorruption(
                    "segment header carries a different engine config than the run's first segment", seq + 1, 0, path
                )
            self._check_continues(header, index, seq, prev_hash, path)
            state = [seq, prev_hash, 0]
            for record in _scan(data, header.size, path, state, is_last=index == last, on_torn=self._on_torn):
                self.position, self.last_seq = (path, state[2]), record[0]
                yield record
            seq, prev_hash = state[0], state[1]

    def _chain_start(self) -> tuple[int, int]:
        """(seq, hash) of the record before the first one read: (0, 0) for a whole run."""
        info = self.header.info
        if info is not None:
            return info.first_seq - 1, info.prev_record_hash
        if self.is_trimmed:  # schema 1 has no segment info: trust the first record
            return _first_record_chain(read_file(self.path), self.header.size)
        return 0, 0

    def _expected_info(self, index: int, seq: int, prev_hash: int) -> SegmentInfo | None:
        first = self.header.info
        if first is None:
            return None
        return SegmentInfo(first.run_number, first.run_id, self.first_segment + index, seq + 1, prev_hash)

    def _check_continues(self, header: LogHeader, index: int, seq: int, prev_hash: int, path: str) -> None:
        """A schema 2 segment's header says where it sits: it must be where the chain is."""
        want = self._expected_info(index, seq, prev_hash)
        if header.info is None or want is None:
            if (header.info is None) != (want is None):
                raise LogCorruption("segments of one run have different schema versions", seq + 1, 0, path)
            return
        if header.info != want:
            raise LogCorruption(
                f"broken chain: the segment header says segment {header.info.segment} from seq "
                f"{header.info.first_seq}, expected segment {want.segment} from seq {want.first_seq}",
                seq + 1,
                0,
                path,
            )
        if want.segment == 1 and (want.first_seq, want.prev_record_hash) != (1, 0):
            raise LogCorruption("broken chain: the run's first segment does not start at seq 1", seq + 1, 0, path)

    def _is_torn_header(self, data: bytes, index: int, seq: int, prev_hash: int) -> bool:
        """A segment cut while its header was written: a strict prefix of the header it must have."""
        info = self._expected_info(index, seq, prev_hash)
        if info is None:
            expected = read_header_bytes(self.path)  # schema 1: every segment has segment 1's header
        else:
            expected = encode_header(self.header.config_json, info, self.header.schema_version)
        return len(data) < len(expected) and expected.startswith(data)

    def _on_torn_segment(self, path: str, data: bytes) -> None:
        warnings.warn(f"{path}: torn segment header ({len(data)} bytes) dropped", stacklevel=3)
        self.torn_tail = (path, 0)
        if self.repair:
            os.rename(path, f"{path}.torn-0")

    def _on_torn(self, path: str, data: bytes, offset: int) -> None:
        warnings.warn(f"{path}: torn last record at byte {offset} ({len(data) - offset} bytes) dropped", stacklevel=3)
        self.torn_tail = (path, offset)
        if self.repair:
            with open(f"{path}.torn-{offset}", "wb") as aside:
                aside.write(data[offset:])
            os.truncate(path, offset)


def _segment_number(path: str, header: LogHeader) -> int:
    if header.info is not None:
        return header.info.segment
    parsed = parse_name(os.path.basename(path))
    return parsed.segment if parsed is not None else 1


def _first_record_chain(data: bytes, offset: int) -> tuple[int, int]:
    """(seq - 1, prev_record_hash) of the record at `offset`, or (0, 0) if it does not read
    (the scan then reports it)."""
    try:
        length = RECORD_HEAD.unpack_from(data, offset)[0]
        seq, prev_hash, _ = _envelope_decoder.decode(data[offset + 8 : offset + 8 + length])
    except (struct.error, msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return 0, 0
    return seq - 1, prev_hash


def _scan(
    data: bytes, offset: int, path: str, state: list[int], is_last: bool, on_torn: Any
) -> Iterator[tuple[int, msgspec.Raw]]:
    """Hot loop: keep it flat. `state` is [seq, prev_hash, offset], updated as records pass."""
    seq, prev_hash = state[0], state[1]
    end = len(data)
    unpack = RECORD_HEAD.unpack_from
    crc32 = zlib.crc32
    xxh = xxhash.xxh64_intdigest
    decode = _envelope_decoder.decode
    view = memoryview(data)
    while offset < end:
        if offset + 8 > end:
            length = crc = -1
        else:
            length, crc = unpack(data, offset)
        stop = offset + 8 + length
        payload = view[offset + 8 : stop]
        if length <= 0 or length > MAX_RECORD_BYTES or stop > end or crc32(payload) != crc:
            check_bad_record(data, offset, length, seq + 1, path, is_last)
            on_torn(path, data, offset)
            break
        try:
            got_seq, chained, raw = decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise LogCorruption(f"record does not decode: {exc}", seq + 1, offset, path) from None
        if got_seq != seq + 1:
            raise LogCorruption(f"broken chain: record has seq {got_seq}, expected {seq + 1}", seq + 1, offset, path)
        if chained != prev_hash:
            raise LogCorruption(
                "broken hash chain: prev_record_hash does not match the previous record", got_seq, offset, path
            )
        seq = got_seq
        prev_hash = xxh(payload)
        state[0], state[1], state[2] = seq, prev_hash, offset
        yield seq, raw
        offset = stop


class EventLogReader:
    """Iterates `(seq, event)` over a run. Opening checks every record of every segment
    and cuts a torn last record off (`repair=False` only skips it)."""

    def __init__(self, path: str, repair: bool = True) -> None:
        scanner = RunScanner(path, repair=repair)
        for _ in scanner:
            pass
        self.path = scanner.path
        self.segments = scanner.segments
        self.header: LogHeader = scanner.header
        self.torn_tail = scanner.torn_tail
        self.first_segment = scanner.first_segment
        self.is_trimmed = scanner.is_trimmed

    @property
    def config_json(self) -> bytes:
        return self.header.config_json

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        decoder = codec.log_event_decoder()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned once, on open
            scanner = RunScanner(self.path, repair=False)
            for seq, raw in scanner:
                try:
                    event = decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                    path, offset = scanner.position
                    raise LogCorruption(f"event does not decode: {exc}", seq, offset, path) from None
                yield seq, event
