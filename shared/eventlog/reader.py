"""Reading a run: every record's checksum, seq and chain are checked, across segments.

A record cut short at the end of the run's last segment (a torn write) is dropped with a
warning, and with `repair=True` cut off the file (its bytes are kept aside in
`<segment>.torn-<offset>`). A torn record anywhere else, a bad checksum, a broken chain or
an undecodable record raises LogCorruption with the seq and byte offset.
"""

from __future__ import annotations

import os
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import msgspec
import xxhash

from shared import codec
from shared.eventlog.format import MAGIC, MAX_RECORD_BYTES, RECORD_HEAD, U32, LogCorruption, LogHeader, parse_header
from shared.eventlog.names import run_segments

_envelope_decoder = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


class RunScanner:
    """Iterates `(seq, raw_event)` over a run's segments: `raw_event` is the event's
    msgpack bytes (msgspec.Raw), checked but not decoded."""

    def __init__(self, path: str, repair: bool = False) -> None:
        self.segments = run_segments(path)
        self.path = self.segments[0]
        self.repair = repair
        self.header = parse_header(_read_head(self.path), self.path)
        self.torn_tail: tuple[str, int] | None = None  # (segment, offset) of a dropped torn record

    @property
    def config_json(self) -> bytes:
        return self.header.config_json

    def __iter__(self) -> Iterator[tuple[int, msgspec.Raw]]:
        seq, prev_hash = 0, 0
        last = len(self.segments) - 1
        for index, path in enumerate(self.segments):
            data = _read(path)
            if index == last and index > 0 and self._is_torn_header(data):
                self._on_torn_segment(path, data)
                return
            header = parse_header(data, path)
            if header.config_json != self.header.config_json:
                raise LogCorruption("segment header carries a different engine config than segment 1", seq + 1, 0, path)
            state = [seq, prev_hash]
            yield from _scan(data, header.size, path, state, is_last=index == last, on_torn=self._on_torn)
            seq, prev_hash = state

    def _is_torn_header(self, data: bytes) -> bool:
        """A segment cut while its header was written: a strict prefix of segment 1's header."""
        with open(self.path, "rb") as f:
            first = f.read(self.header.size)
        return len(data) < len(first) and first.startswith(data)

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


def _read_head(path: str) -> bytes:
    with open(path, "rb") as f:
        fixed = f.read(len(MAGIC) + 8)
        config_len = U32.unpack_from(fixed, len(MAGIC) + 4)[0] if len(fixed) == len(MAGIC) + 8 else 0
        return fixed + f.read(min(config_len, MAX_RECORD_BYTES) + 4)


def _scan(data: bytes, offset: int, path: str, state: list[int], is_last: bool, on_torn: Any) -> Iterator[tuple[int, msgspec.Raw]]:
    """Hot loop: keep it flat. `state` is [seq, prev_hash], updated as records pass."""
    seq, prev_hash = state
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
        if length > MAX_RECORD_BYTES:
            raise LogCorruption(f"record length {length} is implausible", seq + 1, offset, path)
        stop = offset + 8 + length
        if length < 0 or stop > end:
            if not is_last:
                raise LogCorruption("segment ends in a torn record, but it is not the run's last segment", seq + 1, offset, path)
            if _whole_record_after(data, offset + 1):
                raise LogCorruption(f"record length {length} runs past the end, but whole records follow", seq + 1, offset, path)
            on_torn(path, data, offset)
            break
        payload = view[offset + 8 : stop]
        if crc32(payload) != crc:
            raise LogCorruption("bad record checksum", seq + 1, offset, path)
        try:
            got_seq, chained, raw = decode(payload)
        except msgspec.DecodeError as exc:
            raise LogCorruption(f"record does not decode: {exc}", seq + 1, offset, path) from None
        if got_seq != seq + 1:
            raise LogCorruption(f"broken chain: record has seq {got_seq}, expected {seq + 1}", seq + 1, offset, path)
        if chained != prev_hash:
            raise LogCorruption("broken hash chain: prev_record_hash does not match the previous record", got_seq, offset, path)
        seq = got_seq
        prev_hash = xxh(payload)
        state[0], state[1] = seq, prev_hash
        yield seq, raw
        offset = stop


def _whole_record_after(data: bytes, start: int) -> bool:
    """Whether a checksummed record starts anywhere in data[start:]: then a record that
    seems to run past the end has a damaged length, and is no torn tail."""
    end = len(data)
    for offset in range(start, end - 8):
        length, crc = RECORD_HEAD.unpack_from(data, offset)
        if 0 < length <= end - offset - 8 and zlib.crc32(data[offset + 8 : offset + 8 + length]) == crc:
            return True
    return False


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

    @property
    def config_json(self) -> bytes:
        return self.header.config_json

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        decoder = codec.log_event_decoder()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned once, on open
            for seq, raw in RunScanner(self.path, repair=False):
                try:
                    yield seq, decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    raise LogCorruption(f"event does not decode: {exc}", seq, -1, self.path) from None
