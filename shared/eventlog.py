"""The append-only event log (DESIGN.md §3).

File layout, little-endian:

    header:  b"LSEVTLOG"  u32 schema_version  u32 config_len  config_json  u32 crc32(version..config)
    records: u32 length  u32 crc32(payload)  payload = msgpack [seq, prev_record_hash, event]

`seq` starts at 1 and grows by one; `prev_record_hash` is xxhash64 of the previous record's
payload (0 for the first). A record cut short at the end of the file (a torn write) is
truncated on open with a warning; a bad checksum, a broken chain or an undecodable record
anywhere else raises `LogCorruption` with the seq and byte offset.
"""

from __future__ import annotations

import os
import re
import struct
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import msgspec
import xxhash

from shared import codec

MAGIC = b"LSEVTLOG"
SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 1 << 28
_U32 = struct.Struct("<I")
_RECORD_HEAD = struct.Struct("<II")  # length, crc32
_LOG_NAME = re.compile(r"^events-(\d{6,})(?:-([A-Za-z0-9._-]+))?\.log$")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_envelope_decoder = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_envelope_encoder = msgspec.msgpack.Encoder()


class LogCorruption(Exception):
    def __init__(self, message: str, seq: int | None, offset: int) -> None:
        super().__init__(f"{message} (seq {seq}, byte offset {offset})")
        self.seq = seq
        self.offset = offset


@dataclass(frozen=True)
class LogHeader:
    schema_version: int
    config_json: bytes
    size: int  # bytes, where the first record starts


# ---------------------------------------------------------------------- names


def log_number(name: str) -> int | None:
    match = _LOG_NAME.match(name)
    return int(match.group(1)) if match else None


def list_logs(directory: str) -> list[str]:
    """Log files in `directory`, oldest first (by their number, then name)."""
    numbered = [(log_number(name), name) for name in os.listdir(directory)]
    return [os.path.join(directory, name) for n, name in sorted((n, name) for n, name in numbered if n is not None)]


def newest_log(directory: str) -> str:
    logs = list_logs(directory)
    if not logs:
        raise FileNotFoundError(f"no events-*.log file in {directory}")
    return logs[-1]


def next_log_name(directory: str, run_id: str | None) -> str:
    """`events-<n>-<run_id>.log` with n one more than the highest number in `directory`."""
    if run_id is not None and not _RUN_ID.match(run_id):
        raise ValueError(f"run id must match {_RUN_ID.pattern}, got {run_id!r}")
    numbers = [log_number(name) for name in os.listdir(directory)]
    n = max([x for x in numbers if x is not None], default=0) + 1
    return f"events-{n:06d}.log" if run_id is None else f"events-{n:06d}-{run_id}.log"


# ---------------------------------------------------------------------- encoding


def encode_header(config_json: bytes, schema_version: int = SCHEMA_VERSION) -> bytes:
    body = _U32.pack(schema_version) + _U32.pack(len(config_json)) + config_json
    return MAGIC + body + _U32.pack(zlib.crc32(body))


def encode_record(seq: int, prev_record_hash: int, event: Any) -> bytes:
    payload = _envelope_encoder.encode([seq, prev_record_hash, msgspec.Raw(codec.encode(event))])
    return _RECORD_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def record_hash(payload: bytes) -> int:
    return xxhash.xxh64_intdigest(payload)


def read_header(f: BinaryIO) -> LogHeader:
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
        raise LogCorruption("not an event log: bad magic or short header", None, 0)
    version, config_len = _U32.unpack_from(head, len(MAGIC))[0], _U32.unpack_from(head, len(MAGIC) + 4)[0]
    config_json = f.read(config_len)
    crc = f.read(4)
    if len(config_json) < config_len or len(crc) < 4 or _U32.unpack(crc)[0] != zlib.crc32(head[len(MAGIC) :] + config_json):
        raise LogCorruption("event log header is damaged", None, 0)
    if version != SCHEMA_VERSION:
        raise LogCorruption(f"event log schema version {version}; this build reads {SCHEMA_VERSION}", None, 0)
    return LogHeader(version, config_json, len(head) + config_len + 4)


# ---------------------------------------------------------------------- writer


class EventLogWriter:
    """Appends events to a new log file; `seq` is assigned here, from 1."""

    def __init__(self, directory: str, config_json: bytes, run_id: str | None = None) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, next_log_name(directory, run_id))
        self._file: BinaryIO = open(self.path, "xb")
        self._file.write(encode_header(config_json))
        self._seq = 0
        self._prev_hash = 0

    @property
    def last_seq(self) -> int:
        return self._seq

    def append(self, event: Any) -> int:
        if self._file.closed:
            raise ValueError(f"event log {self.path} is closed")
        self._seq += 1
        record = encode_record(self._seq, self._prev_hash, event)
        self._file.write(record)
        self._prev_hash = record_hash(record[_RECORD_HEAD.size :])
        return self._seq

    def flush(self, fsync: bool = False) -> None:
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if not self._file.closed:
            self.flush(fsync=True)
            self._file.close()

    def __enter__(self) -> "EventLogWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- reader


class _TornTail(Exception):
    def __init__(self, offset: int, num_bytes: int) -> None:
        self.offset = offset
        self.num_bytes = num_bytes


class EventLogReader:
    """Iterates `(seq, event)`. Opening checks every record's checksum and chain, and cuts
    a torn last record off the file (`repair=False` only skips it)."""

    def __init__(self, path: str, repair: bool = True) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.header = read_header(f)
            try:
                for _ in _scan(f, self.header.size, decode=False):
                    pass
            except _TornTail as torn:
                warnings.warn(f"{path}: torn last record at byte {torn.offset} ({torn.num_bytes} bytes) truncated", stacklevel=2)
                if repair:
                    os.truncate(path, torn.offset)
                self._end = torn.offset
            else:
                self._end = None

    @property
    def config_json(self) -> bytes:
        return self.header.config_json

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        with open(self.path, "rb") as f:
            f.seek(self.header.size)
            try:
                for _, seq, event in _scan(f, self.header.size, decode=True, end=self._end):
                    yield seq, event
            except _TornTail:
                return  # the file grew a torn tail after open: stop at the last whole record


def _scan(f: BinaryIO, offset: int, decode: bool, end: int | None = None) -> Iterator[tuple[int, int, Any]]:
    decoder = codec.log_event_decoder()
    f.seek(offset)
    seq, prev_hash = 0, 0
    while end is None or offset < end:
        head = f.read(_RECORD_HEAD.size)
        if not head:
            return
        length, crc = _RECORD_HEAD.unpack(head) if len(head) == _RECORD_HEAD.size else (0, 0)
        if length > MAX_RECORD_BYTES:
            raise LogCorruption(f"record length {length} is implausible", seq + 1, offset)
        payload = f.read(length) if len(head) == _RECORD_HEAD.size else b""
        if len(head) < _RECORD_HEAD.size or len(payload) < length:
            raise _TornTail(offset, len(head) + len(payload))
        seq, prev_hash, event = _check_record(payload, crc, seq + 1, prev_hash, offset, decoder if decode else None)
        yield offset, seq, event
        offset += _RECORD_HEAD.size + length


def _check_record(payload: bytes, crc: int, expected_seq: int, prev_hash: int, offset: int, decoder: Any) -> tuple[int, int, Any]:
    if zlib.crc32(payload) != crc:
        raise LogCorruption("bad record checksum", expected_seq, offset)
    try:
        seq, chained_hash, raw = _envelope_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise LogCorruption(f"record does not decode: {exc}", expected_seq, offset) from None
    if seq != expected_seq:
        raise LogCorruption(f"record has seq {seq}, expected {expected_seq}", expected_seq, offset)
    if chained_hash != prev_hash:
        raise LogCorruption("broken hash chain: prev_record_hash does not match the previous record", seq, offset)
    event = None
    if decoder is not None:
        try:
            event = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise LogCorruption(f"event does not decode: {exc}", seq, offset) from None
    return seq, record_hash(payload), event
