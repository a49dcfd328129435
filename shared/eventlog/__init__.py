"""The append-only event log (DESIGN.md §3): format, names, writer, reader."""

from shared.eventlog.format import (
    MAGIC,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    LogCorruption,
    LogHeader,
    LogWriteError,
    encode_header,
    encode_record,
    parse_header,
    record_hash,
)
from shared.eventlog.names import list_logs, log_number, newest_log, next_log_name, run_segments, segment_file_name
from shared.eventlog.reader import EventLogReader, RunScanner
from shared.eventlog.writer import FSYNC_POLICIES, EventLogWriter

__all__ = [
    "FSYNC_POLICIES",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "SCHEMA_VERSION",
    "EventLogReader",
    "EventLogWriter",
    "LogCorruption",
    "LogHeader",
    "LogWriteError",
    "RunScanner",
    "encode_header",
    "encode_record",
    "list_logs",
    "log_number",
    "newest_log",
    "next_log_name",
    "parse_header",
    "record_hash",
    "run_segments",
    "segment_file_name",
]
