"""`ledgerserve replay` on damaged and crafted logs: every one ends in exit 2 (or 0 for a torn
tail, dropped with a warning) with a message naming the segment and byte offset; never a
traceback, never exit 1 (a divergence), never a wait on a FIFO, and in bounded time and memory:
a garbage tail is scanned in linear time and no length field turns into an allocation."""

from __future__ import annotations

import os
import struct
import threading
import time
import tracemalloc
import zlib
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ledgerserve.scheduler_proc.core import Core
from ledgerserve.scheduler_proc.replay import main
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import parse_header, record_hash
from ledgerserve.shared.eventlog.format import MAGIC, RECORD_HEAD, U32, encode_header
from tests.scheduler_proc.logtools import record

_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
HYPOTHESIS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    path = record(tmp_path_factory.mktemp("good")).path
    return os.path.basename(path), Path(path).read_bytes()


def _replay(tmp_path: Path, name: str, data: bytes, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """Exit status and stderr of `ledgerserve replay` on `data` written as a log."""
    directory = tmp_path / f"log-{time.monotonic_ns()}"
    directory.mkdir()
    path = directory / name
    path.write_bytes(data)
    capsys.readouterr()
    code = main([str(path)])
    return code, capsys.readouterr().err


def _check_refused(code: int, err: str, data: bytes, good: bytes) -> None:
    """Exit 2 naming the place; or 0 only for a torn tail dropped with a warning, or for the
    log cut at a record boundary (what a crash between two records leaves)."""
    assert code in (0, 2), err
    if code == 2:
        assert "Traceback" not in err and ("byte offset" in err or "not a regular file" in err), err
    elif not (good.startswith(data) and len(data) in record_offsets_of(good) + [len(good)]):
        assert "torn" in err, err


def _chain_end(data: bytes) -> tuple[int, int]:
    """(seq, hash) of the last record of a one-segment log."""
    seq, prev_hash = 0, 0
    for offset in record_offsets_of(data):
        length = RECORD_HEAD.unpack_from(data, offset)[0]
        payload = data[offset + 8 : offset + 8 + length]
        seq, prev_hash = _ENVELOPE.decode(payload)[0], record_hash(payload)
    return seq, prev_hash


def record_offsets_of(data: bytes) -> list[int]:
    offsets, offset = [], parse_header(data).size
    while offset < len(data):
        offsets.append(offset)
        offset += 8 + RECORD_HEAD.unpack_from(data, offset)[0]
    return offsets


def _with_record(data: bytes, event_bytes: bytes) -> bytes:
    """`data` and one more record, with a valid checksum and chain, holding `event_bytes`."""
    seq, prev_hash = _chain_end(data)
    payload = msgspec.msgpack.encode([seq + 1, prev_hash, msgspec.Raw(event_bytes)])
    return data + RECORD_HEAD.pack(len(payload), zlib.crc32(payload)) + payload


def _damage(original: bytes, data: st.DataObject) -> bytes:
    """Bytes flipped, cut or spliced in, or a record's length field claiming up to 4 GiB."""
    damaged = bytearray(original)
    action = data.draw(st.sampled_from(["flip", "truncate", "splice", "length"]))
    where = data.draw(st.integers(0, len(original) - 1))
    if action == "flip":
        damaged[where] ^= data.draw(st.integers(1, 255))
    elif action == "truncate":
        del damaged[where:]
    elif action == "splice":
        damaged[where:where] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        offset = data.draw(st.sampled_from(record_offsets_of(original)))
        struct.pack_into("<I", damaged, offset, data.draw(st.integers(len(original), 0xFFFFFFFF)))
    return bytes(damaged)


@HYPOTHESIS
@given(data=st.data(), event=st.binary(max_size=200))
def test_damaged_or_crafted_records_end_in_exit_2_or_a_torn_tail(good, tmp_path, capsys, data, event) -> None:
    """Damaged bytes: exit 2 naming the place, or a torn tail dropped with a warning. A record
    whose checksum and chain hold but whose bytes are no event (a crafted log): always exit 2."""
    name, original = good
    damaged = _damage(original, data)
    code, err = _replay(tmp_path, name, damaged, capsys)
    _check_refused(code, err, damaged, original)
    code, err = _replay(tmp_path, name, _with_record(original, event), capsys)
    assert code == 2 and "byte offset" in err and "Traceback" not in err, err


@HYPOTHESIS
@given(header=st.binary(max_size=96), tail=st.binary(max_size=256), config=st.binary(max_size=64))
def test_random_bytes_and_crafted_headers_are_refused(good, tmp_path, capsys, header, tail, config) -> None:
    """Random bytes, a crafted header, or a sound header around an engine config that is no
    config: exit 2 naming the file and byte offset 0."""
    name, original = good
    body = original[parse_header(original).size :]
    crafted = encode_header(config, parse_header(original).info) + body
    for data in (header + tail, MAGIC + header + tail, MAGIC + U32.pack(4) + header + tail, crafted):
        code, err = _replay(tmp_path, name, data, capsys)
        assert code == 2 and f"{name}: " in err and "byte offset 0" in err and "Traceback" not in err, err


_DEEP = b"\x91" * 100_000 + b"\x00"
_CRAFTED_EVENTS = [
    _DEEP,  # nested far past any recursion limit
    b"\x92\xaeRequestArrived" + _DEEP,
    b"\xdd\xff\xff\xff\xff",  # an array of 4 billion items, then nothing
    b"\xdb\xff\xff\xff\xffabc",  # a 4 GiB string
    b"\x97\xaeRequestArrived\xa1a\xdd\xff\xff\xff\xff\x01",  # prompt_token_ids claims 4 billion ids
    msgspec.msgpack.encode(1),
    msgspec.msgpack.encode(["NoSuchEvent", 1]),
    msgspec.msgpack.encode(["RequestArrived", 5, "not a list"]),
    b"",
]


def test_a_checksummed_record_without_a_readable_event_is_refused(good, tmp_path, capsys) -> None:
    name, original = good
    seq = _chain_end(original)[0] + 1
    for crafted in _CRAFTED_EVENTS:
        data = _with_record(original, crafted)
        code, err = _replay(tmp_path, name, data, capsys)
        where = f"{name}: record "  # does not decode, or holds no readable event
        assert code == 2 and where in err and f"(seq {seq}, byte offset {len(original)})" in err, (crafted[:16], err)


def test_diff_refuses_a_crafted_log_with_its_place(good, tmp_path, capsys) -> None:
    name, original = good
    (tmp_path / "good").mkdir()
    (tmp_path / "good" / name).write_bytes(original)
    for crafted in (b"\x00", msgspec.msgpack.encode(["RequestArrived", 5]), _DEEP):
        data = _with_record(original, crafted)
        (tmp_path / "crafted").mkdir(exist_ok=True)
        (tmp_path / "crafted" / name).write_bytes(data)
        capsys.readouterr()
        code = main([str(tmp_path / "good" / name), "--diff", str(tmp_path / "crafted" / name)])
        err = capsys.readouterr().err
        assert code == 2 and f"byte offset {len(original)})" in err and "Traceback" not in err, err


def test_an_input_the_core_cannot_apply_is_refused_with_its_place(good, tmp_path, capsys, monkeypatch) -> None:
    """An input the core raises on (none that decodes is known: the core stands in for a fault)
    ends the replay as a damaged log at that record, not with a traceback or exit 1."""
    name, original = good
    data = _with_record(original, codec.encode(ev.RequestAborted("crafted")))
    apply = Core.apply

    def raising(core: Core, event: object) -> list:
        if isinstance(event, ev.RequestAborted) and event.req_id == "crafted":
            raise KeyError("crafted")
        return apply(core, event)

    monkeypatch.setattr(Core, "apply", raising)
    code, err = _replay(tmp_path, name, data, capsys)
    where = f"(seq {_chain_end(original)[0] + 1}, byte offset {record_offsets_of(data)[-1]})"
    assert code == 2 and "cannot apply this RequestAborted: KeyError" in err and where in err, err


def test_a_garbage_tail_is_scanned_in_linear_time(good, tmp_path, capsys) -> None:
    """8 MiB crafted so that every 8th byte starts something shaped like a record of 4 KiB: a
    quadratic scan takes hours; a linear one refuses it within its budget, in seconds."""
    name, original = good
    unit = struct.pack("<I", 0x1093) + b"\x00\x00\x00\x00"  # length 4243; 8 bytes on: 0x93, then seq 16
    path = tmp_path / name
    path.write_bytes(original + unit * (1 << 20))
    assert _main_within([str(path)], timeout_s=60) == 2
    err = capsys.readouterr().err
    assert "linear time" in err and f"byte offset {len(original)}" in err, err


def test_a_length_field_never_becomes_an_allocation(good, tmp_path, capsys) -> None:
    """A header claiming a 4 GiB engine config, a record claiming 2 GiB: read as what the file holds."""
    name, original = good
    first = record_offsets_of(original)[0]
    claims = [
        MAGIC + U32.pack(4) + U32.pack(0xFFFFFFF0) + b"{}" * 8,
        original[:first] + struct.pack("<I", 0x7FFFFFFF) + original[first + 4 :],
    ]
    tracemalloc.start()
    try:
        for data in claims:
            tracemalloc.reset_peak()
            code, err = _replay(tmp_path, name, data, capsys)
            assert code == 2 and "byte offset" in err, err
            assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def _main_within(args: list[str], timeout_s: float = 10.0) -> int | None:
    """main(args), or None if it did not return in time (it waited on something)."""
    results: list[int] = []
    worker = threading.Thread(target=lambda: results.append(main(args)), daemon=True)
    worker.start()
    worker.join(timeout_s)
    return results[0] if results else None


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
def test_an_entry_that_is_not_a_regular_file_is_refused_at_once(tmp_path, capsys, kind) -> None:
    """Named as the log, or the newest run of the directory given: exit 2 at once, never a wait."""
    entry = tmp_path / "events-000001-x.log"
    if kind == "fifo":
        os.mkfifo(entry)
    elif kind == "directory":
        entry.mkdir()
    else:
        entry.symlink_to(os.devnull)
    paths = [tmp_path] if kind == "directory" else [entry, tmp_path]
    for path in paths:
        assert _main_within([str(path)]) == 2, f"replay of {path} waited"
        assert f"{entry}: not a regular file" in capsys.readouterr().err
