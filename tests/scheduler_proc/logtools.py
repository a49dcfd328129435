"""Helpers for event-log tests: record a driver workload, find and edit records on disk."""

from __future__ import annotations

import os
from typing import Any

from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter, parse_header
from ledgerserve.shared.eventlog.format import SCHEMA_VERSION, encode_header
from ledgerserve.sim.workload import run_workload
from tests.scheduler_proc.driver import Driver

ENGINE = EngineConfig(
    model_dir="m", served_model_name="m", max_model_len=32, max_num_seqs=4, max_num_batched_tokens=16, block_size=4
)


def record(directory: Any, seed: int = 3, num_events: int = 80, **writer_args: Any) -> EventLogWriter:
    """A seeded driver workload logged as the shell logs it; returns the closed writer."""
    writer = EventLogWriter(str(directory), ENGINE.to_json(), run_id="test", **writer_args)
    d = Driver(10, max_num_seqs=4, max_num_batched_tokens=16, block_size=4, max_model_len=32, log=writer)
    run_workload(d, seed, num_events=num_events)
    writer.append(ev.LogClosed("done"))
    writer.close()
    return writer


def rewrite(path: str, directory: Any, change: Any) -> str:
    """Copy the log into `directory`, passing each (seq, event) through `change`. The copy
    keeps the source's schema version, so replay reads its decisions by the same rules."""
    reader = EventLogReader(path)
    with EventLogWriter(str(directory), reader.config_json, run_id="copy") as writer:
        for seq, event in reader:
            writer.append(change(seq, event))
    with open(path, "rb") as f:
        schema_version = parse_header(f.read()).schema_version
    if schema_version < SCHEMA_VERSION:
        _with_old_header(writer.path, reader.config_json, schema_version)
    return writer.path


def _with_old_header(path: str, config_json: bytes, schema_version: int) -> None:
    """Give a one-segment log written today the header of an older schema (schema 1: no
    segment info; schema 2: the same segment info)."""
    with open(path, "rb") as f:
        data = f.read()
    header = parse_header(data)
    info = header.info if schema_version >= 2 else None
    with open(path, "wb") as f:
        f.write(encode_header(config_json, info, schema_version) + data[header.size :])


def record_offsets(path: str) -> list[int]:
    """Byte offset of every record in one segment file."""
    with open(path, "rb") as f:
        data = f.read()
    offsets, offset = [], parse_header(data).size
    while offset < len(data):
        offsets.append(offset)
        offset += 8 + int.from_bytes(data[offset : offset + 4], "little")
    return offsets


def flip_byte(path: str, where: int) -> None:
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)
        f.seek(where)
        f.write(bytes([byte[0] ^ 0xFF]))


def cut(path: str, num_bytes: int) -> None:
    os.truncate(path, os.path.getsize(path) - num_bytes)
