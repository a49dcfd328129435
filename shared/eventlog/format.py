"""On-disk format of the event log (docs/architecture.md, "The event log"), little-endian:

    header:  b"LSEVTLOG"  u32 schema_version  u32 config_len  config_json
             u32 info_len  info = msgpack [run_number, run_id, segment, first_seq, prev_record_hash]
             u32 crc32(version..info)
    records: u32 length  u32 crc32(payload)  payload = msgpack [seq, prev_record_hash, event]

`seq` starts at 1 and grows by one across a run; `prev_record_hash` is xxhash64 of the
previous record's payload (0 for the first record of a run). Every segment of a run starts
with its own header; the chain continues across segments, and the header's `info` says
where: the segment's number in its run, the seq of its first record and the hash that
record chains to. So a run whose first segments were removed (retention) still reads, and
is known to be trimmed.

Schema 1 (still read): the same without `info_len` and `info`. Its logs also hold
StateDigests that list every prefix namespace ever evicted (`Policy.keep_dropped_namespaces`,
scheduler_proc/core/policy.py).

Schema 2 (still read): the format of schema 3; its engines loaded every adapter in command
order, so it replays with `Policy.overlap_loading` off whatever its config says.

Schema 3 (still read): the format of schema 4; its engines, with overlapped loading, barred
every adapter request behind an aged request with no slot instead of draining one slot for it,
so it replays with `Policy.targeted_drain` off.

Schema 4 (still read): the format of schema 5; each of its AdapterOpReplied carried the whole
adapter registry (a log that grew with the square of the adapter ops), so it replays with
`Policy.op_reply_registry` on.

Schema 5 (still read): the format of schema 6; its StateDigests, with overlapped loading, also
hashed which ranks had reported each slot load in flight and each CPU-tier staging: reports no
decision waits on, whose timing differs from run to run, so two runs of the same traffic had
other digests. It replays with `Policy.digest_load_reports` on.
"""

from __future__ import annotations

import os
import stat
import struct
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from ledgerserve.shared import codec

MAGIC = b"LSEVTLOG"
SCHEMA_VERSION = 6
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6)
MAX_RECORD_BYTES = 1 << 28
U32 = struct.Struct("<I")
RECORD_HEAD = struct.Struct("<II")  # length, crc32
_HEAD_FIXED = len(MAGIC) + 8
_envelope_encoder = msgspec.msgpack.Encoder()
_MAX_INFO_BYTES = 1024


class LogCorruption(Exception):
    """The log is damaged where it must not be: reported with the seq and byte offset."""

    def __init__(self, message: str, seq: int | None, offset: int, path: str | None = None) -> None:
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{message} (seq {seq}, byte offset {offset})")
        self.seq = seq
        self.offset = offset
        self.path = path


class NotRegularFile(OSError):
    """A log path that names a FIFO, a device, a socket or a directory: refused before any read
    (a read could block for ever, or never end)."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path}: not a regular file ({kind}); an event log segment is a regular file")
        self.path = path
        self.kind = kind


class LogWriteError(Exception):
    """Writing or syncing the log failed; the engine must stop rather than serve unlogged."""

    def __init__(self, path: str, action: str, cause: BaseException) -> None:
        super().__init__(f"event log {path}: {action} failed: {cause}")
        self.path = path
        self.action = action
        self.cause = cause

    @property
    def reason(self) -> str:
        """What failed, without the path or the file name: fit to leave this machine."""
        errno = getattr(self.cause, "errno", None)
        return f"{self.action} failed: {os.strerror(errno) if errno else type(self.cause).__name__}"


class SegmentInfo(msgspec.Struct, array_like=True, frozen=True):
    """Where a segment sits in its run (schema 2 headers)."""

    run_number: int
    run_id: str
    segment: int  # from 1
    first_seq: int  # the seq of the segment's first record
    prev_record_hash: int  # what that record's prev_record_hash must be


@dataclass(frozen=True)
class LogHeader:
    schema_version: int
    config_json: bytes
    size: int  # bytes, where the first record starts
    info: SegmentInfo | None = None  # None in schema 1


def encode_header(config_json: bytes, info: SegmentInfo | None, schema_version: int = SCHEMA_VERSION) -> bytes:
    """Schema 2 needs `info`; schema 1 (for tests of old logs) has none."""
    body = U32.pack(schema_version) + U32.pack(len(config_json)) + config_json
    if schema_version >= 2:
        if info is None:
            raise ValueError("a schema 2 header needs its segment info")
        packed = msgspec.msgpack.encode(info)
        body += U32.pack(len(packed)) + packed
    return MAGIC + body + U32.pack(zlib.crc32(body))


def encode_record(seq: int, prev_record_hash: int, event: Any, encoded: bytes | None = None) -> bytes:
    """`encoded`: the event's `codec.encode` bytes when the caller already has them."""
    frame = codec.encode(event) if encoded is None else encoded
    payload = _envelope_encoder.encode([seq, prev_record_hash, msgspec.Raw(frame)])
    return RECORD_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def record_hash(payload: bytes) -> int:
    return xxhash.xxh64_intdigest(payload)


def header_end(data: bytes) -> int | None:
    """How long the header at the start of `data` says it is (crc included), from the
    length fields present; None while `data` is too short to tell."""
    if len(data) < _HEAD_FIXED:
        return None
    version = U32.unpack_from(data, len(MAGIC))[0]
    end = _HEAD_FIXED + U32.unpack_from(data, len(MAGIC) + 4)[0]
    if version >= 2:
        if len(data) < end + 4:
            return None
        end += 4 + U32.unpack_from(data, end)[0]
    return end + 4


def is_cut_header(data: bytes) -> bool:
    """`data` (a whole file) stops inside its header: what a start that failed while writing
    it leaves (0 bytes included). A complete but damaged header is not cut."""
    if not MAGIC.startswith(data[: len(MAGIC)]):
        return False
    end = header_end(data)
    return end is None or len(data) < end


def parse_header(data: bytes, path: str | None = None) -> LogHeader:
    """The header at the start of `data` (a whole segment, or at least its header)."""
    if len(data) < _HEAD_FIXED or data[: len(MAGIC)] != MAGIC:
        raise LogCorruption("not an event log: bad magic or short header", None, 0, path)
    version = U32.unpack_from(data, len(MAGIC))[0]
    if version not in READABLE_SCHEMA_VERSIONS:
        raise LogCorruption(
            f"event log schema version {version}; this build reads {READABLE_SCHEMA_VERSIONS}", None, 0, path
        )
    config_end = _HEAD_FIXED + U32.unpack_from(data, len(MAGIC) + 4)[0]
    end = header_end(data)
    if end is None or len(data) < end or U32.unpack_from(data, end - 4)[0] != zlib.crc32(data[len(MAGIC) : end - 4]):
        raise LogCorruption("event log header is damaged", None, 0, path)
    info = None
    if version >= 2:
        try:
            info = msgspec.msgpack.decode(data[config_end + 4 : end - 4], type=SegmentInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise LogCorruption(f"event log header's segment info does not decode: {exc}", None, 0, path) from None
    return LogHeader(version, bytes(data[_HEAD_FIXED:config_end]), end, info)


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


@contextmanager
def open_regular(path: str) -> Iterator[tuple[Any, int]]:
    """(binary file, size) of the regular file `path`; NotRegularFile for anything else. Opened
    without blocking, so a FIFO is refused at once rather than waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kinds = [name for test, name in _KINDS if test(mode)]
            raise NotRegularFile(path, kinds[0] if kinds else "a device or other special file")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, os.fstat(f.fileno()).st_size


def read_file(path: str) -> bytes:
    """The whole of the regular file `path` (NotRegularFile for anything else)."""
    with open_regular(path) as (f, _):
        return f.read()


def read_header_bytes(path: str) -> bytes:
    """The bytes of the header at the start of the file `path` (fewer if it is cut). Its length
    fields never make a read longer than the file."""
    with open_regular(path) as (f, size):
        data = f.read(_HEAD_FIXED)
        if len(data) < _HEAD_FIXED:
            return data
        version = U32.unpack_from(data, len(MAGIC))[0]
        config_len = U32.unpack_from(data, len(MAGIC) + 4)[0]
        data += f.read(min(config_len + 4, MAX_RECORD_BYTES, size - len(data)))
        if version >= 2 and len(data) == _HEAD_FIXED + config_len + 4:
            info_len = U32.unpack_from(data, len(data) - 4)[0]
            data += f.read(min(info_len, _MAX_INFO_BYTES) + 4)
        return data
