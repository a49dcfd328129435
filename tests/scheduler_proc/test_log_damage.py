"""Each kind of damage, through `ledgerserve replay`: exit 2 naming seq and byte offset,
except a torn tail, which is dropped with a warning."""

import json
import random

import pytest

from ledgerserve.scheduler_proc.replay import main, replay
from ledgerserve.shared.eventlog import EventLogReader, LogCorruption
from tests.scheduler_proc.logtools import cut, flip_byte, record, record_offsets


def test_torn_tail_is_dropped_with_a_warning_and_replay_is_read_only(tmp_path, capsys):
    path = record(tmp_path).path
    with open(path, "ab") as f:
        f.write(b"\x40\x00\x00\x00\x01\x02\x03\x04half a rec")
    size = len(open(path, "rb").read())
    assert main([path, "--verify"]) == 0
    captured = capsys.readouterr()
    assert "torn last record" in captured.err and captured.out.startswith("OK")
    assert len(open(path, "rb").read()) == size  # replay never writes the log
    with pytest.warns(UserWarning, match="torn last record"):
        EventLogReader(path)  # the library's reader repairs on open...
    assert len(open(path, "rb").read()) < size
    assert len(list(tmp_path.glob("*.torn-*"))) == 1  # ...keeping the cut bytes aside


def test_flipped_byte_mid_log(tmp_path, capsys):
    path = record(tmp_path).path
    offsets = record_offsets(path)
    flip_byte(path, offsets[20] + 11)
    assert main([path]) == 2
    err = capsys.readouterr().err
    assert f"bad record checksum (seq 21, byte offset {offsets[20]})" in err
    assert main([path, "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["status"] == "corrupt"


def test_reordered_records_break_the_chain(tmp_path, capsys):
    path = record(tmp_path).path
    offsets = record_offsets(path)
    data = open(path, "rb").read()
    a, b, c = offsets[10], offsets[11], offsets[12]
    with open(path, "wb") as f:
        f.write(data[:a] + data[b:c] + data[a:b] + data[c:])
    with pytest.raises(LogCorruption, match="broken chain") as info:
        replay(path)
    assert (info.value.seq, info.value.offset) == (11, a)
    assert main([path]) == 2
    assert f"(seq 11, byte offset {a})" in capsys.readouterr().err


def test_length_past_the_end_in_the_middle_is_not_a_torn_tail(tmp_path, capsys):
    path = record(tmp_path).path
    offsets = record_offsets(path)
    flip_byte(path, offsets[5] + 3)  # the top byte of the length: implausibly large
    assert main([path]) == 2
    assert "implausible" in capsys.readouterr().err


def test_damaged_length_running_past_the_end_is_not_a_torn_tail(tmp_path, capsys):
    path = record(tmp_path).path
    offsets = record_offsets(path)
    size = len(open(path, "rb").read())
    with open(path, "r+b") as f:
        f.seek(offsets[5])
        f.write((size - offsets[5]).to_bytes(4, "little"))  # plausible, but past the end
    assert main([path]) == 2
    assert f"runs past the end, but whole records follow (seq 6, byte offset {offsets[5]})" in capsys.readouterr().err
    with pytest.raises(LogCorruption):
        EventLogReader(path)  # and the repairing reader does not cut the file
    assert len(open(path, "rb").read()) == size


def test_torn_header_of_the_only_segment_is_corruption(tmp_path, capsys):
    path = record(tmp_path).path
    with open(path, "r+b") as f:
        f.truncate(10)
    assert main([path]) == 2
    assert "header" in capsys.readouterr().err


def test_missing_log(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no events-*.log" in capsys.readouterr().err


def test_cut_tail_of_the_last_record(tmp_path):
    path = record(tmp_path).path
    cut(path, 3)
    with pytest.warns(UserWarning):
        result = replay(path)
    assert result.ok and result.torn_tail is not None


@pytest.mark.parametrize("tail", [bytes(4096), random.Random(5).randbytes(777)], ids=["zeros", "garbage"])
def test_zero_filled_or_garbage_tail_is_a_torn_tail(tmp_path, capsys, tail):
    writer = record(tmp_path)
    with open(writer.path, "ab") as f:
        f.write(tail)  # what a crash can leave past the last good record
    assert main([writer.path, "--verify"]) == 0
    captured = capsys.readouterr()
    assert "torn last record" in captured.err and captured.out.startswith("OK")
    assert f"last seq {writer.last_seq}" in captured.out


def test_zeroed_record_followed_by_good_ones_is_corruption(tmp_path, capsys):
    path = record(tmp_path).path
    offsets = record_offsets(path)
    with open(path, "r+b") as f:
        f.seek(offsets[7])
        f.write(bytes(offsets[8] - offsets[7]))
    assert main([path, "--verify"]) == 2
    assert f"record of length 0 (seq 8, byte offset {offsets[7]})" in capsys.readouterr().err


def test_zero_filled_tail_of_an_earlier_segment_is_corruption(tmp_path, capsys):
    writer = record(tmp_path, num_events=200, max_bytes=2048)
    with open(writer.segment_paths[0], "ab") as f:
        f.write(bytes(64))
    assert main([writer.path]) == 2
    assert "record of length 0" in capsys.readouterr().err
