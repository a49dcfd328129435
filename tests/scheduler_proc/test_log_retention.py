"""Retention (--event-log-max-total-bytes): the shell keeps the log directory within its
bound across runs, never removing the segment being written; replay of a run that lost its
start says so (exit 3) instead of verifying or showing what it cannot."""

from __future__ import annotations

import json
import os

import pytest

import ledgerserve.scheduler_proc.loop as loop
from ledgerserve.scheduler_proc.replay import main
from ledgerserve.shared import codec
from ledgerserve.shared import events as ev
from ledgerserve.shared.config import EngineConfig
from ledgerserve.shared.eventlog import (
    EventLogReader,
    EventLogWriter,
    LogFile,
    encode_header,
    encode_record,
    enforce_retention,
    plan_removals,
    record_hash,
)
from ledgerserve.shared.eventlog.names import parse_name
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import FakeWorker
from tests.scheduler_proc.logtools import ENGINE, flip_byte, record, record_offsets

MAX_BYTES = 4096
MAX_TOTAL_BYTES = 4 * MAX_BYTES


class Sink:
    """Stands in for every socket of the shell: keeps what is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(frame)

    def send_multipart(self, frames, flags: int = 0) -> None:
        self.sent.extend(frames)

    def close(self, linger: int | None = None) -> None:
        pass


def _log_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory) if parse_name(n))


def _shell(tmp_path, monkeypatch) -> loop.SchedulerShell:
    monkeypatch.setattr(loop.ipc, "bind", lambda *args: Sink())
    config = EngineConfig(
        model_dir="m",
        served_model_name="m",
        max_model_len=32,
        max_num_seqs=4,
        max_num_batched_tokens=16,
        block_size=4,
        event_log_dir=str(tmp_path / "logs"),
        run_dir=str(tmp_path),
        event_log_fsync="never",
        event_log_max_bytes=MAX_BYTES,
        event_log_max_total_bytes=MAX_TOTAL_BYTES,
    )
    return loop.SchedulerShell(config)


def _serve(shell: loop.SchedulerShell, num_reqs: int) -> None:
    """A run: arrivals, then a fake worker completes every step. After every input the
    directory is within its bound and the segment being written is there."""
    directory = shell.config.event_log_dir
    worker, decode = FakeWorker(4), codec.to_worker_decoder()
    inputs = [ev.WorkerReady(0, 64, 1000, [2], "cpu", "float32")]
    inputs += [
        ev.RequestArrived(f"r{i}", [5 + i % 7] * (3 + i % 5), SamplingParams(max_tokens=6)) for i in range(num_reqs)
    ]
    for event in inputs:
        shell.handle(event)
    while shell.core.in_flight:
        plan = next(p for p in map(decode.decode, reversed(shell.to_workers[0].sent)) if isinstance(p, ev.StepPlan))
        shell.handle(ev.StepCompleted(plan.step, 0, [ev.SampledToken(r, 7) for r in worker.apply(plan)]))
        assert _log_bytes(directory) <= MAX_TOTAL_BYTES and os.path.exists(shell.log.current_path)
    shell.request_stop("done")
    shell._close()


def test_runs_and_segments_stay_within_the_bound(tmp_path, monkeypatch, capsys):
    directory = str(tmp_path / "logs")
    first = _shell(tmp_path, monkeypatch)
    _serve(first, num_reqs=6)
    assert len(first.log.segment_paths) >= 2
    second = _shell(tmp_path, monkeypatch)
    _serve(second, num_reqs=8)
    assert not os.path.exists(first.log.path)  # the older run went first, whole
    assert main([directory, "--verify"]) == 0  # the second run is whole: it verifies
    third = _shell(tmp_path, monkeypatch)
    _serve(third, num_reqs=30)  # more than the bound holds: the run trims its own oldest segments
    left = sorted(os.listdir(directory))
    assert all(name.startswith(os.path.basename(third.log.path)[:-4]) for name in left)
    assert os.path.basename(third.log.path) not in left and os.path.basename(third.log.current_path) in left
    assert _log_bytes(directory) <= MAX_TOTAL_BYTES
    reader = EventLogReader(third.log.current_path)
    assert reader.is_trimmed and reader.first_segment > 1
    seqs = [seq for seq, _ in reader]
    assert seqs == list(range(seqs[0], third.log.last_seq + 1)) and seqs[0] > 1
    capsys.readouterr()
    assert main([directory, "--verify"]) == 3
    err = capsys.readouterr().err
    assert "history is trimmed" in err and f"seq {seqs[0]}-{seqs[-1]}" in err and "--event-log-max-total-bytes" in err


def _trimmed_run(tmp_path) -> EventLogWriter:
    writer = record(tmp_path, num_events=200, max_bytes=2048)
    assert len(writer.segment_paths) >= 4
    for path in writer.segment_paths[:2]:
        os.remove(path)
    return writer


def test_show_and_at_step_of_a_trimmed_run_say_why_they_cannot(tmp_path, capsys):
    writer = _trimmed_run(tmp_path)
    for argv in ([str(tmp_path), "--show", "all", "--at-step", "3"], [writer.segment_paths[-1], "--until", "400"]):
        assert main(argv) == 3
        out, err = capsys.readouterr()
        assert out == "" and "divergence" not in err
        assert "segments 1-2" in err and "without it nothing can be verified or shown" in err
    assert main([str(tmp_path), "--json"]) == 3
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "trimmed" and report["exit_code"] == 3
    other = record(tmp_path / "other", num_events=200).path
    assert main([other, "--diff", writer.segment_paths[2]]) == 3


def test_damage_in_what_is_left_of_a_trimmed_run_is_corruption(tmp_path, capsys):
    writer = _trimmed_run(tmp_path)
    third = writer.segment_paths[2]
    flip_byte(third, record_offsets(third)[1] + 9)
    assert main([str(tmp_path)]) == 2
    assert "bad record checksum" in capsys.readouterr().err


def test_a_schema_1_run_trimmed_by_hand_reads_from_its_first_record(tmp_path, capsys):
    config = ENGINE.to_json()
    records, prev = [], 0
    for seq in range(1, 7):
        records.append(encode_record(seq, prev, ev.LogClosed(f"r{seq}")))
        prev = record_hash(records[-1][8:])
    for segment, chunk in ((1, records[:3]), (2, records[3:])):
        name = "events-000001-old.log" if segment == 1 else "events-000001-old+000002.log"
        (tmp_path / name).write_bytes(encode_header(config, None, schema_version=1) + b"".join(chunk))
    os.remove(tmp_path / "events-000001-old.log")
    reader = EventLogReader(str(tmp_path), repair=False)
    assert reader.is_trimmed and [seq for seq, _ in reader] == [4, 5, 6]
    assert main([str(tmp_path)]) == 3 and "seq 4-6" in capsys.readouterr().err


def _file(name: str, num_bytes: int) -> LogFile:
    parsed = parse_name(name)
    assert parsed is not None
    return LogFile(parsed, f"/logs/{name}", num_bytes)


def test_removal_order_runs_first_then_own_oldest_segments_never_the_active_one():
    files = [
        _file("events-000001-a.log", 100),
        _file("events-000001-a+000002.log", 100),
        _file("events-000002-b.log", 50),
        _file("events-000003-c.log", 100),
        _file("events-000003-c+000002.log", 100),
        _file("events-000003-c+000003.log", 10),
    ]
    active = "/logs/events-000003-c+000003.log"
    names = lambda removals: [os.path.basename(f.path) for f in removals]  # noqa: E731
    assert plan_removals(files, active, 460 + 100, 100, set()) == []
    assert names(plan_removals(files, active, 460, 100, set())) == ["events-000001-a.log", "events-000001-a+000002.log"]
    assert names(plan_removals(files, active, 460, 100, {(1, "a")})) == ["events-000002-b.log", "events-000003-c.log"]
    everything_but_active = plan_removals(files, active, 0, 100, set())
    assert len(everything_but_active) == 5 and active not in [f.path for f in everything_but_active]


def test_a_run_another_writer_holds_is_never_removed(tmp_path):
    old = record(tmp_path, num_events=40)  # closed: removable
    live = EventLogWriter(str(tmp_path), ENGINE.to_json(), run_id="live")  # another engine, writing
    for i in range(200):
        live.append(ev.LogClosed(f"busy {i}"))
    live.flush()
    mine = EventLogWriter(str(tmp_path), ENGINE.to_json(), run_id="mine")
    removed, num_bytes = enforce_retention(str(tmp_path), 1, mine.current_path, 0)
    assert removed == [old.path] and os.path.exists(live.path) and os.path.exists(mine.path)
    assert num_bytes == os.path.getsize(live.path) + os.path.getsize(mine.path)  # still over: reported
    live.close()
    assert enforce_retention(str(tmp_path), 1, mine.current_path, 0) == ([live.path], os.path.getsize(mine.path))
    mine.close()


def test_the_bound_is_validated_against_the_segment_size():
    with pytest.raises(ValueError, match="at least twice event_log_max_bytes"):
        EngineConfig(
            model_dir="m",
            served_model_name="m",
            max_model_len=8,
            event_log_max_bytes=8192,
            event_log_max_total_bytes=8192,
        )
    assert EngineConfig(model_dir="m", served_model_name="m", max_model_len=8, event_log_max_total_bytes=0)
    assert b'"event_log_max_total_bytes":4294967296' in ENGINE.to_json()  # logged in every header
