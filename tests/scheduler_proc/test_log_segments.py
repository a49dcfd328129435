"""Segment rotation: a run across segments replays as one; only its last segment may be torn."""

import os

import pytest

from ledgerserve.scheduler_proc.replay import main, replay
from ledgerserve.shared.eventlog import EventLogReader, list_logs, newest_log, parse_header, run_segments
from tests.scheduler_proc.logtools import cut, record, record_offsets


def _rotated(tmp_path):
    writer = record(tmp_path, num_events=200, max_bytes=2048)
    assert len(writer.segment_paths) >= 3
    return writer


def test_rotation_keeps_segments_under_the_limit_with_their_own_header(tmp_path):
    writer = _rotated(tmp_path)
    names = [os.path.basename(p) for p in writer.segment_paths]
    assert names[0] == "events-000001-test.log" and names[1] == "events-000001-test+000002.log"
    for path in writer.segment_paths:
        data = open(path, "rb").read()
        assert parse_header(data).size < len(data) <= 2048 or len(record_offsets(path)) == 1
    assert list_logs(str(tmp_path)) == [writer.path] and newest_log(str(tmp_path)) == writer.path
    assert run_segments(writer.segment_paths[1]) == writer.segment_paths


def test_replay_verifies_the_whole_run_from_any_segment(tmp_path, capsys):
    writer = _rotated(tmp_path)
    result = replay(writer.segment_paths[-1])
    assert result.ok and not result.truncated_tail and result.last_seq == writer.last_seq
    assert result.segments == writer.segment_paths
    assert [seq for seq, _ in EventLogReader(writer.path)] == list(range(1, writer.last_seq + 1))
    assert main([str(tmp_path), "--verify"]) == 0
    assert f"{len(writer.segment_paths)} segment(s)" in capsys.readouterr().out


def test_truncated_middle_segment_is_corruption(tmp_path, capsys):
    writer = _rotated(tmp_path)
    middle = writer.segment_paths[1]
    cut(middle, 5)
    assert main([writer.path]) == 2
    err = capsys.readouterr().err
    assert middle in err and "not the run's last segment" in err and "byte offset" in err


def test_torn_last_segment_is_dropped(tmp_path):
    writer = _rotated(tmp_path)
    cut(writer.segment_paths[-1], 3)
    with pytest.warns(UserWarning, match="torn last record"):
        result = replay(writer.path)
    assert result.ok and result.last_seq == writer.last_seq - 1


def test_missing_middle_segment(tmp_path, capsys):
    writer = _rotated(tmp_path)
    os.remove(writer.segment_paths[1])
    assert main([writer.path]) == 2
    assert "segment 2" in capsys.readouterr().err


def test_segments_swapped_break_the_chain(tmp_path, capsys):
    writer = _rotated(tmp_path)
    second, third = writer.segment_paths[1], writer.segment_paths[2]
    os.rename(second, second + ".tmp")
    os.rename(third, second)
    os.rename(second + ".tmp", third)
    assert main([writer.path]) == 2
    assert "broken chain" in capsys.readouterr().err


def test_last_segment_torn_in_its_header(tmp_path):
    writer = _rotated(tmp_path)
    last = writer.segment_paths[-1]
    with open(last, "r+b") as f:
        f.truncate(12)
    with pytest.warns(UserWarning, match="torn segment header"):
        result = replay(writer.path)
    assert result.ok and result.segments == writer.segment_paths
    with pytest.warns(UserWarning):
        EventLogReader(writer.path)  # the repairing reader sets the stub aside
    assert run_segments(writer.path) == writer.segment_paths[:-1]
