"""The append-only event log (docs/architecture.md, "The event log"): format, names, writer, reader, retention."""

from ledgerserve.shared.eventlog.format import (
    MAGIC,
    MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    LogCorruption,
    LogHeader,
    LogWriteError,
    SegmentInfo,
    encode_header,
    encode_record,
    parse_header,
    record_hash,
)
from ledgerserve.shared.eventlog.names import (
    list_logs,
    log_number,
    newest_log,
    next_log_name,
    run_segments,
    segment_file_name,
)
from ledgerserve.shared.eventlog.reader import EventLogReader, RunScanner
from ledgerserve.shared.eventlog.retention import LogFile, enforce_retention, plan_removals
from ledgerserve.shared.eventlog.writer import FSYNC_POLICIES, EventLogWriter

__all__ = [
    "FSYNC_POLICIES",
    "MAGIC",
    "MAX_RECORD_BYTES",
    "SCHEMA_VERSION",
    "EventLogReader",
    "EventLogWriter",
    "LogCorruption",
    "LogFile",
    "LogHeader",
    "LogWriteError",
    "RunScanner",
    "SegmentInfo",
    "encode_header",
    "encode_record",
    "enforce_retention",
    "list_logs",
    "log_number",
    "newest_log",
    "next_log_name",
    "parse_header",
    "plan_removals",
    "record_hash",
    "run_segments",
    "segment_file_name",
]
