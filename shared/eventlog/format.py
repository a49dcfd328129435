"""On-disk format of the event log (DESIGN.md §3), little-endian:

    header:  b"LSEVTLOG"  u32 schema_version  u32 config_len  config_json  u32 crc32(version..config)
    records: u32 length  u32 crc32(payload)  payload = msgpack [seq, prev_record_hash, event]

`seq` starts at 1 and grows by one across a run; `prev_record_hash` is xxhash64 of the
previous record's payload (0 for the first record of a run). Every segment of a run starts
with its own header; the chain continues across segments.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from shared import codec

MAGIC = b"LSEVTLOG"
SCHEMA_VERSION = 1
MAX_RECORD_BYTES = 1 << 28
U32 = struct.Struct("<I")
RECORD_HEAD = struct.Struct("<II")  # length, crc32
_HEAD_FIXED = len(MAGIC) + 8
_envelope_encoder = msgspec.msgpack.Encoder()


class LogCorruption(Exception):
    """The log is damaged where it must not be: reported with the seq and byte offset."""

    def __init__(self, message: str, seq: int | None, offset: int, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{message} (seq {seq}, byte offset {offset})")
        self.seq = seq
        self.offset = offset
        self.path = path


class LogWriteError(Exception):
    """Writing or syncing the log failed; the engine must stop rather than serve unlogged."""

    def __init__(self, path: str, action: str, cause: BaseException) -> None:
        super().__init__(f"event log {path}: {action} failed: {cause}")
        self.path = path
        self.cause = cause


@dataclass(frozen=True)
class LogHeader:
    schema_version: int
    config_json: bytes
    size: int  # bytes, where the first record starts


def encode_header(config_json: bytes, schema_version: int = SCHEMA_VERSION) -> bytes:
    body = U32.pack(schema_version) + U32.pack(len(config_json)) + config_json
    return MAGIC + body + U32.pack(zlib.crc32(body))


def encode_record(seq: int, prev_record_hash: int, event: Any, encoded: bytes | None = None) -> bytes:
    """`encoded`: the event's `codec.encode` bytes when the caller already has them."""
    frame = codec.encode(event) if encoded is None else encoded
    payload = _envelope_encoder.encode([seq, prev_record_hash, msgspec.Raw(frame)])
    return RECORD_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def record_hash(payload: bytes) -> int:
    return xxhash.xxh64_intdigest(payload)


def parse_header(data: bytes, path: str | None = None) -> LogHeader:
    """The header at the start of `data` (a whole segment, or at least its header)."""
    if len(data) < _HEAD_FIXED or data[: len(MAGIC)] != MAGIC:
        raise LogCorruption("not an event log: bad magic or short header", None, 0, path)
    version = U32.unpack_from(data, len(MAGIC))[0]
    config_len = U32.unpack_from(data, len(MAGIC) + 4)[0]
    end = _HEAD_FIXED + config_len
    if len(data) < end + 4 or U32.unpack_from(data, end)[0] != zlib.crc32(data[len(MAGIC) : end]):
        raise LogCorruption("event log header is damaged", None, 0, path)
    if version != SCHEMA_VERSION:
        raise LogCorruption(f"event log schema version {version}; this build reads {SCHEMA_VERSION}", None, 0, path)
    return LogHeader(version, bytes(data[_HEAD_FIXED:end]), end + 4)
