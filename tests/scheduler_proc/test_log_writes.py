"""fsync policy and write errors, in the writer and in the shell (SchedulerShell.handle);
the shell's close after a fault: never raising or blocking, naming the dead process."""

import dataclasses
import errno
import json
import os
import select
import threading
import time

import pytest
import zmq

from ledgerserve.scheduler_proc.core import Core, CoreConfig
from ledgerserve.scheduler_proc.ledger import Ledger
from ledgerserve.scheduler_proc.loop import SchedulerShell
from ledgerserve.scheduler_proc.outbox import HeldFrames
from ledgerserve.scheduler_proc.redaction import Redactor
from ledgerserve.scheduler_proc.replay import main
from ledgerserve.scheduler_proc.replay import main as replay_main
from ledgerserve.scheduler_proc.stats_log import StatsLog
from ledgerserve.scheduler_proc.views.adapter_stats import AdapterStats
from ledgerserve.shared import codec, ipc
from ledgerserve.shared import events as ev
from ledgerserve.shared.eventlog import EventLogReader, EventLogWriter, LogWriteError
from ledgerserve.shared.sampling import SamplingParams
from tests.scheduler_proc.driver import FakeWorker
from tests.scheduler_proc.logtools import ENGINE, record


class FailingFile:
    """A real file whose writes fail with ENOSPC once `armed`."""

    def __init__(self, path, mode):
        self._file = open(path, mode)
        self.armed = False
        self.closed = False

    def write(self, data):
        if self.armed:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._file.write(data)

    def flush(self):
        self._file.flush()

    def fileno(self):
        return self._file.fileno()

    def close(self):
        self.closed = True
        self._file.close()


class FakeSocket:
    """Records what is sent; once `dead`, sends fail as zmq does for a peer that is gone."""

    def __init__(self, decoder=None):
        self.decoder = decoder
        self.sent = []
        self.messages = []  # frames per message sent
        self.dead = False
        self.closed_linger = None
        self.on_poll = lambda: None  # called by each wait for room to send

    def send(self, frame, flags=0):
        if self.dead:
            assert flags & zmq.NOBLOCK, "a blocking send to a dead peer never returns"
            raise zmq.Again()
        self.sent.append(self.decoder.decode(frame))

    def send_multipart(self, frames, flags=0):
        if self.dead:
            self.send(frames[0], flags)  # raises as a dead peer's socket does
        self.messages.append(len(frames))
        for frame in frames:
            self.send(frame, flags)

    def poll(self, timeout_ms, flags):
        self.on_poll()
        return 0

    def close(self, linger=None):
        self.closed_linger = linger


def make_shell(tmp_path, fsync="step", opener=open, core=None, content=None, group_commit=False):
    """The shell with fake sockets; `core` and `content` (a Redactor) replace ENGINE's."""
    shell = SchedulerShell.__new__(SchedulerShell)  # no sockets: the IO is faked below
    shell.config = dataclasses.replace(ENGINE, run_dir=str(tmp_path))
    writer = EventLogWriter(
        str(tmp_path), ENGINE.to_json(), "shell", fsync=fsync, opener=opener, group_commit=group_commit
    )
    default = CoreConfig.from_engine(ENGINE)
    shell.ledger = Ledger(core or Core(default), writer, content or Redactor(ENGINE.event_log_content))
    shell.adapter_stats = AdapterStats(ENGINE.tensor_parallel_size, default.lora_overlap_loading)
    shell.from_tokenizer, shell.from_workers = FakeSocket(), FakeSocket()
    shell.to_tokenizer = FakeSocket(codec.from_scheduler_decoder())
    shell.to_workers = [FakeSocket(codec.to_worker_decoder())]
    shell.num_dropped_frames = 0
    shell.stop, shell.failure, shell.last_stats = None, None, None
    shell.stats_log = StatsLog(0)
    shell.spans = None
    shell.outbox = HeldFrames(lambda frames: shell._send(shell.to_tokenizer, *frames))
    return shell


def drive(shell, num_reqs=3):
    """Arrivals, then a fake worker completes every step; returns the number of inputs."""
    worker, inputs = FakeWorker(ENGINE.block_size), [ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32")]
    inputs += [ev.RequestArrived(f"r{i}", [5] * (3 + i), SamplingParams(max_tokens=4)) for i in range(num_reqs)]
    for event in inputs:
        shell.handle(event)
    handled = len(inputs)
    while shell.core.in_flight:
        plan = shell.to_workers[0].sent[-1]
        sampled = [ev.SampledToken(r, 7) for r in worker.apply(plan)]
        shell.handle(ev.StepCompleted(plan.step, 0, sampled))
        handled += 1
    return handled


@pytest.fixture
def fsyncs(monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    return calls


@pytest.mark.parametrize("policy", ["never", "step", "always"])
def test_fsync_policy_counts(tmp_path, fsyncs, policy):
    shell = make_shell(tmp_path, fsync=policy)
    handled = drive(shell)
    steps = shell.core.step
    assert steps >= 3
    expected = {"never": 0, "step": steps, "always": handled}[policy]  # step: one per step
    assert len(fsyncs) == expected
    shell.log.close()
    assert len(fsyncs) == expected + (policy != "never")  # the close syncs unless never


def test_writer_write_error_names_the_log_and_sticks(tmp_path):
    files = []
    writer = EventLogWriter(str(tmp_path), b"{}", "w", opener=lambda p, m: files.append(FailingFile(p, m)) or files[-1])
    writer.append(ev.LogClosed("one"))
    files[-1].armed = True
    with pytest.raises(LogWriteError, match=r"event log .*events-000001-w\.log: write failed: .*No space") as info:
        writer.append(ev.LogClosed("two"))
    assert isinstance(info.value.cause, OSError)
    with pytest.raises(LogWriteError):
        writer.append(ev.LogClosed("three"))  # broken for good: no silent gaps
    writer.close()  # does not raise
    assert [seq for seq, _ in EventLogReader(writer.path)] == [1]


def test_writer_fsync_error(tmp_path, monkeypatch):
    writer = EventLogWriter(str(tmp_path), b"{}", "w")
    writer.append(ev.LogClosed("one"))
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    writer.commit(step_planned=False)  # no fsync asked: fine
    with pytest.raises(LogWriteError, match="fsync failed"):
        writer.commit(step_planned=True)


def test_shell_stops_with_engine_failed_on_a_write_error(tmp_path, caplog):
    files = []
    shell = make_shell(tmp_path, opener=lambda p, m: files.append(FailingFile(p, m)) or files[-1])
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    files[-1].armed = True
    with caplog.at_level("ERROR", logger="scheduler"):
        shell.handle(ev.RequestArrived("a", [5, 5, 5], SamplingParams(max_tokens=2)))
    assert shell.failed
    failed = [m for m in shell.to_tokenizer.sent if isinstance(m, ev.EngineFailed)]
    assert len(failed) == 1 and "cannot write the event log" in failed[0].message
    assert "No space left on device" in failed[0].message
    for secret in (str(tmp_path), os.path.basename(shell.log.path), "events-"):
        assert secret not in failed[0].message  # what reaches clients names no path or file
    assert shell.log.path in caplog.text  # the server's own log does
    assert not shell.core.requests  # the input was never applied: nothing served unlogged
    shell.handle(ev.RequestArrived("b", [5], SamplingParams()))
    assert not shell.core.requests
    shell._close()  # no exception: it logs the error and leaves the engine failed
    assert shell.failed


class FullDiskFile(FailingFile):
    """A file on a full disk: every write fails, from the first (the header)."""

    def __init__(self, path, mode):
        super().__init__(path, mode)
        self.armed = True


def test_a_start_on_a_full_disk_leaves_no_run_behind(tmp_path, capsys):
    good = record(tmp_path).path
    with pytest.raises(LogWriteError, match="write failed"):
        EventLogWriter(str(tmp_path), b"{}", "full", opener=FullDiskFile)  # the header write fails
    files = []
    shell = make_shell(tmp_path, opener=lambda p, m: files.append(FailingFile(p, m)) or files[-1])
    files[-1].armed = True  # the disk fills before the first input is logged
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    assert shell.failed
    shell._close()
    assert files[-1].closed and sorted(os.listdir(tmp_path)) == [os.path.basename(good)]
    assert main([str(tmp_path), "--verify"]) == 0 and good in capsys.readouterr().out


@pytest.mark.parametrize("content", ["empty", "cut", "header"])
def test_replay_of_a_directory_passes_over_a_run_without_records(tmp_path, capsys, content):
    good = record(tmp_path).path
    empty = EventLogWriter(str(tmp_path), ENGINE.to_json(), "failed")
    empty.close()  # a header alone
    size = {"empty": 0, "cut": 20, "header": os.path.getsize(empty.path)}[content]
    os.truncate(empty.path, size)
    assert main([str(tmp_path), "--verify"]) == 0
    captured = capsys.readouterr()
    assert good in captured.out and f"{empty.path}: skipped: a run without records" in captured.err


def _closed_record(shell) -> ev.LogClosed:
    records = list(EventLogReader(shell.log.path))
    assert isinstance(records[-1][1], ev.LogClosed)
    return records[-1][1]


def _replay_json(path, capsys) -> dict:
    assert replay_main([path, "--verify", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_close_after_a_worker_died_names_it_and_replays(tmp_path, capsys):
    shell = make_shell(tmp_path)
    drive(shell, num_reqs=2)
    shell.handle(ev.RequestArrived("late", [5, 6, 7], SamplingParams(max_tokens=4)))  # its step never completes
    reason = "engine process 'worker-0' died (exit code -9)"
    ipc.write_death_notice(str(tmp_path), ipc.DeathNotice("worker-0", -9, reason))
    shell.to_workers[0].dead = True
    shell.request_stop("stopped by SIGTERM")  # the launcher's SIGTERM after it wrote the notice
    shell._close()  # the Shutdown to the dead worker fails: no exception
    assert _closed_record(shell) == ev.LogClosed(reason, "worker-0", -9)
    sockets = [shell.from_tokenizer, shell.from_workers, shell.to_tokenizer, *shell.to_workers]
    assert all(sock.closed_linger == 0 for sock in sockets)
    report = _replay_json(shell.log.path, capsys)
    assert report["closed"] == {"reason": reason, "dead_process": "worker-0", "exit_code": -9}


def test_a_send_to_a_dead_peer_gives_up_once_a_stop_is_asked(tmp_path, capsys):
    shell = make_shell(tmp_path)
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    tokenizer = shell.to_tokenizer
    tokenizer.dead = True
    polls = []

    def on_poll():  # the 4th wait for room is interrupted by a stop (a signal, or the launcher's death)
        polls.append(1)
        if len(polls) == 4:
            shell.request_stop("gone", "launcher")

    tokenizer.on_poll = on_poll
    shell.handle(ev.RequestArrived("a", [5, 5, 5], SamplingParams(max_tokens=2)))  # its stats meet the dead tokenizer
    assert len(polls) == 4 and shell.stop == ev.LogClosed("gone", "launcher")
    shell._close()
    assert _closed_record(shell) == ev.LogClosed("gone", "launcher")
    assert replay_main([shell.log.path, "--verify"]) == 0
    assert "log closed: gone [dead process: launcher]" in capsys.readouterr().out


def test_a_plain_stop_closes_the_log_naming_no_process(tmp_path):
    shell = make_shell(tmp_path)
    drive(shell, num_reqs=1)
    shell.request_stop("stopped by SIGTERM")
    shell.request_stop("later", "launcher")  # the first ask wins
    shell._close()
    assert _closed_record(shell) == ev.LogClosed("stopped by SIGTERM")


def test_group_commit_holds_output_until_its_records_are_synced(tmp_path, monkeypatch):
    """The fsync runs on its own thread: plans go to the workers while it runs, but no frame reaches
    the HTTP process before the fsync covering its records ended; then all of them go, in order."""
    gate, entered, real = threading.Event(), threading.Event(), os.fsync

    def slow_fsync(fd):
        entered.set()
        assert gate.wait(10)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    shell = make_shell(tmp_path, fsync="step", group_commit=True)
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    shell.handle(ev.RequestArrived("r0", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert entered.wait(10)
    plan = shell.to_workers[0].sent[-1]
    shell.handle(ev.StepCompleted(plan.step, 0, [ev.SampledToken("r0", 7)]))
    assert len(shell.to_workers[0].sent) == 2  # the next plan went at once
    assert shell.to_tokenizer.sent == [] and len(shell.outbox) > 0  # EngineReady, stats, the token: held
    assert shell.log.durable_seq < shell.log.last_seq
    gate.set()
    deadline = time.monotonic() + 10
    while len(shell.outbox) and time.monotonic() < deadline:
        select.select([shell.log.wake_fd], [], [], 0.1)
        shell._on_synced()
    assert len(shell.outbox) == 0 and shell.log.durable_seq == shell.log.last_seq
    sent = shell.to_tokenizer.sent
    assert isinstance(sent[0], ev.EngineReady)
    assert [t.new_token_ids for t in sent if isinstance(t, ev.TokensEmitted)] == [[7]]
    assert len(shell.to_tokenizer.messages) < len(sent)  # what one sync released went as one message
    shell.log.close()


def test_a_failed_group_fsync_releases_nothing_and_stops_the_engine(tmp_path, monkeypatch):
    """The fsync fails once a step has run while it was in flight (it waits for the test's word:
    failing at once, the fsync thread could beat the loop to the request and no step would run)."""
    gate, entered = threading.Event(), threading.Event()

    def failing_fsync(fd):
        entered.set()
        assert gate.wait(10)
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    shell = make_shell(tmp_path, fsync="step", group_commit=True)
    shell.handle(ev.WorkerReady(0, 32, 1000, [2], "cpu", "float32"))
    shell.handle(ev.RequestArrived("r0", [5, 6, 7], SamplingParams(max_tokens=4)))
    assert entered.wait(10)
    plan = shell.to_workers[0].sent[-1]
    shell.handle(ev.StepCompleted(plan.step, 0, [ev.SampledToken("r0", 7)]))
    assert shell.to_tokenizer.sent == [] and len(shell.outbox) > 0  # EngineReady, stats, the token: held
    gate.set()
    select.select([shell.log.wake_fd], [], [], 10)
    shell._on_synced()
    assert shell.failed and "fsync" in shell.failure
    sent = shell.to_tokenizer.sent
    assert [type(e) for e in sent] == [ev.EngineFailed]  # told why; no token, no ready
    shell.log.close()
