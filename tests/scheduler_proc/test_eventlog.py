"""Event log: round trip, torn tail, corruption detection."""

import os
import warnings

import pytest

from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter, LogCorruption, list_logs, newest_log
from ledgerserve.shared.sampling import SamplingParams

CONFIG = b'{"max_model_len": 64}'


def _events():
    return [
        ev.WorkerReady(0, 16, 1000, [2], "cpu", "float32"),
        ev.RequestArrived("a", [1, 2, 3], SamplingParams(max_tokens=2, stop_token_ids=(9,)), arrival_time_s=12.5),
        ev.StepPlan(1, [ev.NewReq("a", [1, 2, 3], 3, SamplingParams(), [0], 0, 3)]),
        ev.StateDigest(1, 2**64 - 1),
        ev.StepCompleted(1, 0, [ev.SampledToken("a", 7, ev.TokenLogprobs(-0.25, [7], [-0.25]))]),
        ev.TokensEmitted("a", [7], None, num_prompt_tokens=3),
        ev.LogClosed("test"),
    ]


def _write(tmp_path, events=None, run_id="run1"):
    with EventLogWriter(str(tmp_path), CONFIG, run_id=run_id) as writer:
        seqs = [writer.append(e) for e in events or _events()]
    return writer.path, seqs


def test_round_trip(tmp_path):
    path, seqs = _write(tmp_path)
    assert seqs == list(range(1, 8))
    reader = EventLogReader(path)
    assert reader.config_json == CONFIG
    assert list(reader) == list(zip(seqs, _events()))


def test_names_sort_and_newest(tmp_path):
    first, _ = _write(tmp_path, run_id="zzz")
    second, _ = _write(tmp_path, run_id="aaa")
    assert os.path.basename(first) == "events-000001-zzz.log"
    assert os.path.basename(second) == "events-000002-aaa.log"
    assert list_logs(str(tmp_path)) == [first, second] and newest_log(str(tmp_path)) == second
    with pytest.raises(ValueError):
        EventLogWriter(str(tmp_path), CONFIG, run_id="../evil")


def test_torn_tail_is_truncated_with_warning(tmp_path):
    path, _ = _write(tmp_path)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02\x03\x04partial")
    with pytest.warns(UserWarning, match="torn last record"):
        reader = EventLogReader(path)
    assert os.path.getsize(path) == size
    assert [seq for seq, _ in reader] == list(range(1, 8))


def test_torn_header_of_last_record(tmp_path):
    path, _ = _write(tmp_path)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1)  # the LogClosed record loses its last byte
    with pytest.warns(UserWarning):
        assert [seq for seq, _ in EventLogReader(path)] == list(range(1, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(EventLogReader(path))) == 6  # repaired: no warning the second time


def _record_offsets(path):
    reader = EventLogReader(path)
    offsets, offset = [], reader.header.size
    with open(path, "rb") as f:
        data = f.read()
    while offset < len(data):
        offsets.append(offset)
        offset += 8 + int.from_bytes(data[offset : offset + 4], "little")
    return offsets


def test_flipped_byte_in_the_middle_reports_seq_and_offset(tmp_path):
    path, _ = _write(tmp_path)
    offsets = _record_offsets(path)
    with open(path, "r+b") as f:
        f.seek(offsets[3] + 12)
        byte = f.read(1)
        f.seek(offsets[3] + 12)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(LogCorruption) as info:
        EventLogReader(path)
    assert info.value.seq == 4 and info.value.offset == offsets[3]
    assert "seq 4" in str(info.value)


def test_broken_chain_detected(tmp_path):
    path, _ = _write(tmp_path)
    offsets = _record_offsets(path)
    with open(path, "rb") as f:
        data = f.read()
    # drop record 3 whole: crc of every record is fine, but seq and chain break
    with open(path, "wb") as f:
        f.write(data[: offsets[2]] + data[offsets[3] :])
    with pytest.raises(LogCorruption) as info:
        EventLogReader(path)
    assert info.value.offset == offsets[2]


def test_bad_magic(tmp_path):
    path = tmp_path / "events-000001.log"
    path.write_bytes(b"NOTALOG" * 4)
    with pytest.raises(LogCorruption, match="magic"):
        EventLogReader(str(path))


def test_wrong_prev_hash_detected(tmp_path):
    from ledgerserve.shared.eventlog import encode_record

    path, _ = _write(tmp_path)
    offsets = _record_offsets(path)
    with open(path, "rb") as f:
        data = f.read()
    forged = encode_record(3, 12345, _events()[2])  # right seq, valid crc, wrong chain
    with open(path, "wb") as f:
        f.write(data[: offsets[2]] + forged + data[offsets[3] :])
    with pytest.raises(LogCorruption, match="broken hash chain") as info:
        EventLogReader(path)
    assert (info.value.seq, info.value.offset) == (3, offsets[2])


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_segments_are_private_whatever_the_umask(tmp_path):
    """Every segment 0600 (rotation's too) in a directory made 0700, its missing parents too, and an
    existing directory of this user tightened: the log may hold request content."""
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    old_umask = os.umask(0)
    try:
        os.chmod(loose, 0o777)
        nested = tmp_path / "new" / "events"
        for directory in (loose, nested):
            with EventLogWriter(str(directory), CONFIG, run_id="run", max_bytes=4096) as writer:
                for i in range(200):
                    writer.append(ev.RequestAborted(f"req-{i}"))
            assert len(writer.segment_paths) > 1
            assert [_mode(p) for p in writer.segment_paths] == [0o600] * len(writer.segment_paths)
            assert _mode(directory) == 0o700
        assert _mode(tmp_path / "new") == 0o700
    finally:
        os.umask(old_umask)
